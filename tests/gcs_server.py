"""gcp-storage-emulator with the two behaviours of real GCS that Orbax's
TensorStore and our workdir lock rely on, which the emulator leaves out.

- Downloads carry ``x-goog-generation`` (TensorStore reads an object's
  generation from that header; without it a read of an OCDBT manifest fails
  now and then with 'Malformed StorageGeneration').
- Uploads and deletes honour ``ifGenerationMatch`` (412 when it does not
  hold), so a create-if-absent object (``ifGenerationMatch=0``) is
  exclusive, as the workdir lock and OCDBT's manifest updates expect, and
  the lock's heartbeat and takeover touch only the generation they read.

Connections get a thread each, requests are handled one at a time (the
emulator's in-memory store has no locks of its own). Run as ``python tests/gcs_server.py start --host ...``
with the emulator's own arguments.
"""

import http
import http.server
import sys
import threading

from gcp_storage_emulator import exceptions
from gcp_storage_emulator import server as emulator_server
from gcp_storage_emulator.handlers import objects

_ONE_AT_A_TIME = threading.RLock()  # handlers call each other


def _serialized(handler):
  def wrapped(request, *args, **kwargs):
    if request.method in ('POST', 'PUT', 'PATCH'):
      # The body is read before the lock: a client that stops sending must
      # not hold up every other request.
      _ = request.data
    with _ONE_AT_A_TIME:
      return handler(request, *args, **kwargs)
  return wrapped


def _with_generation(download):
  def wrapped(request, response, storage, *args, **kwargs):
    try:
      obj = storage.get_file_obj(request.params['bucket_name'],
                                 request.params['object_id'])
      response['x-goog-generation'] = obj['generation']
      response['x-goog-metageneration'] = obj.get('metageneration', '1')
    except exceptions.NotFound:
      pass
    return download(request, response, storage, *args, **kwargs)
  return wrapped


def _object_name(request):
  name = request.query.get('name')
  if name:
    return name[0]
  if request.method == 'DELETE':
    return request.params.get('object_id')
  data = request.data
  if isinstance(data, dict) and isinstance(data.get('meta'), dict):
    return data['meta'].get('name')
  return None


def _with_preconditions(insert):
  def wrapped(request, response, storage, *args, **kwargs):
    want = request.query.get('ifGenerationMatch')
    name = _object_name(request) if want else None
    if want and name is not None:
      try:
        have = storage.get_file_obj(request.params['bucket_name'],
                                    name)['generation']
      except exceptions.NotFound:
        have = '0'
      if str(have) != str(want[0]):
        response.status = http.HTTPStatus.PRECONDITION_FAILED
        response.json({'error': {'code': 412,
                                 'message': 'Precondition Failed'}})
        return None
    return insert(request, response, storage, *args, **kwargs)
  return wrapped


# One thread per connection (the emulator serves one connection at a time,
# so a client's idle keep-alive connection would stall every other client).
emulator_server.server.HTTPServer = http.server.ThreadingHTTPServer
# A connection that sends nothing for a minute is dropped (socket timeout).
emulator_server.RequestHandler.timeout = 60

_WRAPPED = {objects.download: _serialized(_with_generation(objects.download)),
            objects.insert: _serialized(_with_preconditions(objects.insert)),
            objects.delete: _serialized(_with_preconditions(objects.delete))}
for _name in ('get', 'ls', 'patch', 'copy', 'rewrite', 'compose',
              'upload_partial', 'xml_upload', 'batch', 'restore',
              'acl_list'):
  _WRAPPED[getattr(objects, _name)] = _serialized(getattr(objects, _name))
# The handlers' calls of each other go through the module's names; the
# server's routes hold the functions themselves, taken when it was imported
# (without this, requests ran unserialized: two uploads at once once broke
# the store's index with 'dictionary changed size during iteration').
for _original, _wrapper in _WRAPPED.items():
  setattr(objects, _original.__name__, _wrapper)
emulator_server.HANDLERS = tuple(
    (regex, {method: _WRAPPED.get(handler, handler)
             for method, handler in handlers.items()})
    for regex, handlers in emulator_server.HANDLERS)

if __name__ == '__main__':
  from gcp_storage_emulator import __main__ as emulator  # after the patches
  sys.exit(emulator.main())
