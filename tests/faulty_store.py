"""A store in trouble, for the tests: an HTTP proxy on 127.0.0.1 in front of
an object-store server (``gcs_server.py`` or moto) that fails on purpose.

Faults, on a seeded schedule (the same seed fails the same requests of the
same sequence):

- transient, each request with probability ``rate``: an answer 429, 500 or
  503 without forwarding the request (nothing applied upstream, as a real
  store's throttling), a download cut mid-body (forwarded, then the
  connection closed after half the body), or a slow answer (``delay`` s
  before forwarding);
- ``drop_generation``: answers without ``x-goog-generation`` (what the
  bare PyPI emulator does);
- persistent, switched on at run time: ``forbidden`` (every request
  answered 403, an expired credential), ``no_bucket`` (404 bucket not
  found, a deleted bucket), ``down`` (connections accepted and closed at
  once: a store unreachable), ``writes_forbidden`` (403 for uploads and
  deletes only: reads still work, as a read-only credential), ``stall``
  (requests held without an answer for ``STALL_S``: a store that hangs);
  with
  ``match`` set, only requests whose (unquoted) URL contains it fail
  (``checkpoints/``, ``metrics.jsonl``, ``.lock``).

Control: ``POST /__faults__`` with a JSON object of the settings above
(``{"persistent": "forbidden"}``, ``{"rate": 0}``); ``GET /__faults__``
returns the settings and the counts of requests and of each fault served.
Run as ``python tests/faulty_store.py --upstream URL --port P [--seed S]
[--rate R] [--delay D] [--drop_generation]``; ``start`` (below) does that
on a free port.
"""

from __future__ import annotations

import argparse
import http.client
import http.server
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request

import object_stores

CONTROL = '/__faults__'
STALL_S = 600.0
_TRANSIENT = ('429', '500', '503', 'cut', 'slow')
_PERSISTENT = ('forbidden', 'no_bucket', 'down', 'writes_forbidden',
               'stall')
# Hop-by-hop headers a proxy does not pass on (RFC 9110 7.6.1).
_HOP = {'connection', 'keep-alive', 'proxy-authenticate',
        'proxy-authorization', 'te', 'trailer', 'transfer-encoding',
        'upgrade', 'content-length'}


class Schedule:
  """What happens to each request: seeded, thread-safe, switchable."""

  def __init__(self, seed: int, rate: float, delay: float,
               drop_generation: bool):
    self._rng = random.Random(seed)
    self._lock = threading.Lock()
    self.settings = {'rate': rate, 'delay': delay,
                     'drop_generation': drop_generation, 'persistent': None,
                     'match': None}
    self.counts = {'requests': 0, **{k: 0 for k in _TRANSIENT + _PERSISTENT}}

  def update(self, changes: dict):
    with self._lock:
      unknown = set(changes) - set(self.settings)
      if unknown or changes.get('persistent') not in (None, *_PERSISTENT):
        raise ValueError(f'unknown fault settings: {changes}')
      self.settings.update(changes)

  def draw(self, method: str, path: str) -> str | None:
    """The fault for the next request (None: forward it unchanged)."""
    with self._lock:
      self.counts['requests'] += 1
      persistent = self.settings['persistent']
      if persistent == 'writes_forbidden' and method == 'GET':
        persistent = None
      match = self.settings['match']
      if match and match not in urllib.parse.unquote(path):
        persistent = None
      if persistent:
        self.counts[persistent] += 1
        return persistent
      if self._rng.random() >= self.settings['rate']:
        return None
      fault = self._rng.choice(_TRANSIENT if method == 'GET'
                               else tuple(f for f in _TRANSIENT if f != 'cut'))
      self.counts[fault] += 1
      return fault

  def report(self) -> dict:
    with self._lock:
      return {'settings': dict(self.settings), 'counts': dict(self.counts)}


def _error_body(code: int, text: str) -> bytes:
  return json.dumps({'error': {'code': code, 'message': text,
                               'errors': [{'message': text}]}}).encode()


def make_handler(upstream: str, schedule: Schedule):
  target = urllib.parse.urlsplit(upstream)

  class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = 'HTTP/1.1'

    def log_message(self, *args):  # quiet: the tests read the counts
      del args

    def _body(self) -> bytes:
      length = int(self.headers.get('Content-Length') or 0)
      return self.rfile.read(length) if length else b''

    def _answer(self, code: int, body: bytes, headers=()):
      self.send_response(code)
      for k, v in headers:
        self.send_header(k, v)
      self.send_header('Content-Type', 'application/json')
      self.send_header('Content-Length', str(len(body)))
      self.end_headers()
      if self.command != 'HEAD':  # an answer to HEAD has no body
        self.wfile.write(body)

    def _control(self, body: bytes):
      if self.command == 'POST':
        try:
          schedule.update(json.loads(body or b'{}'))
        except ValueError as e:
          return self._answer(400, _error_body(400, str(e)))
      return self._answer(200, json.dumps(schedule.report()).encode())

    def _proxy(self):
      body = self._body()
      if self.path.startswith(CONTROL):
        return self._control(body)
      fault = schedule.draw(self.command, self.path)
      if fault == 'stall':
        time.sleep(STALL_S)
      if fault in ('down', 'stall'):
        self.close_connection = True
        self.connection.shutdown(socket.SHUT_RDWR)
        return None
      if fault in ('forbidden', 'writes_forbidden'):
        return self._answer(403, _error_body(
            403, 'faulty_store: the credential has no access (Forbidden)'))
      if fault == 'no_bucket':
        return self._answer(404, _error_body(
            404, 'faulty_store: The specified bucket does not exist.'))
      if fault in ('429', '500', '503'):
        return self._answer(int(fault), _error_body(
            int(fault), f'faulty_store: transient {fault}'),
            [('Retry-After', '0')])
      if fault == 'slow':
        time.sleep(schedule.settings['delay'])
      conn = http.client.HTTPConnection(target.hostname, target.port,
                                        timeout=120)
      try:
        headers = {k: v for k, v in self.headers.items()
                   if k.lower() not in _HOP and k.lower() != 'host'}
        headers['Host'] = target.netloc
        conn.request(self.command, self.path, body=body or None,
                     headers=headers)
        answer = conn.getresponse()
        data = answer.read()
      finally:
        conn.close()
      self.send_response(answer.status, answer.reason)
      for k, v in answer.getheaders():
        if k.lower() == 'content-length' and self.command == 'HEAD':
          self.send_header(k, v)  # the object's size, with no body
          continue
        if k.lower() in _HOP:
          continue
        if schedule.settings['drop_generation'] and k.lower().startswith(
            ('x-goog-generation', 'x-goog-metageneration')):
          continue
        self.send_header(k, v)
      if self.command != 'HEAD':
        self.send_header('Content-Length', str(len(data)))
      self.end_headers()
      if fault == 'cut' and len(data) > 1:
        self.wfile.write(data[:len(data) // 2])
        self.wfile.flush()
        self.close_connection = True
        self.connection.shutdown(socket.SHUT_RDWR)
        return None
      self.wfile.write(data)
      return None

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = _proxy

  return Handler


class Proxy:
  """A running proxy (a subprocess): ``url`` to route clients to,
  ``set(**settings)`` to change the faults, ``report()`` for the counts."""

  def __init__(self, proc: subprocess.Popen, url: str):
    self.proc, self.url = proc, url

  def _call(self, data: bytes | None = None) -> dict:
    request = urllib.request.Request(self.url + CONTROL, data=data,
                                     method='POST' if data else 'GET')
    with urllib.request.urlopen(request, timeout=10) as answer:
      return json.loads(answer.read())

  def set(self, **settings) -> dict:
    return self._call(json.dumps(settings).encode())

  def report(self) -> dict:
    return self._call()

  def env(self, server_env: dict[str, str]) -> dict[str, str]:
    """``server_env`` (the variables routing clients to the store) with
    every URL of the store replaced by this proxy's."""
    upstream = self.upstream
    return {k: (self.url if v == upstream else v)
            for k, v in server_env.items()}

  def stop(self):
    object_stores.stop(self.proc)


def start(upstream: str, seed: int = 0, rate: float = 0.0,
          delay: float = 0.5, drop_generation: bool = False) -> Proxy:
  """Starts a proxy in front of ``upstream`` (``http://127.0.0.1:PORT``) on
  a free port of 127.0.0.1 and waits until it answers."""
  port = object_stores.free_port()
  args = [sys.executable, os.path.abspath(__file__), '--upstream', upstream,
          '--port', str(port), '--seed', str(seed), '--rate', str(rate),
          '--delay', str(delay)] + (['--drop_generation'] if drop_generation
                                    else [])
  proc = subprocess.Popen(args, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
  proxy = Proxy(proc, f'http://127.0.0.1:{port}')
  proxy.upstream = upstream
  deadline = time.time() + 30
  while True:
    try:
      proxy.report()
      return proxy
    except OSError:
      if proc.poll() is not None or time.time() > deadline:
        proxy.stop()
        raise RuntimeError(f'faulty_store did not start on port {port}')
      time.sleep(0.1)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--upstream', required=True)
  parser.add_argument('--port', type=int, required=True)
  parser.add_argument('--seed', type=int, default=0)
  parser.add_argument('--rate', type=float, default=0.0)
  parser.add_argument('--delay', type=float, default=0.5)
  parser.add_argument('--drop_generation', action='store_true')
  a = parser.parse_args()
  schedule = Schedule(a.seed, a.rate, a.delay, a.drop_generation)
  server = http.server.ThreadingHTTPServer(
      ('127.0.0.1', a.port), make_handler(a.upstream, schedule))
  server.daemon_threads = True
  server.serve_forever()


if __name__ == '__main__':
  main()
