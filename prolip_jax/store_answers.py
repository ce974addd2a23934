"""What a failed request to an object store said, found in an exception's
chain: the HTTP status and the store's words, and what to do.

The clients report a store's answer each their own way: gcsfs as
``HttpError`` (or ``OSError('Forbidden: ...')``, ``FileNotFoundError`` of an
API URL) after its retries, s3fs as an ``OSError`` caused by botocore's
``ClientError``, TensorStore (through Orbax) as the text of a
``ValueError`` (``'PERMISSION_DENIED: ... [http_response_code='403']'``,
``'CURL error ...'``), aiohttp as its connection errors. ``errors`` turns
what ``store_fault`` finds into one ``StoreError`` line. Standard library
only: errors.py imports this.
"""

from __future__ import annotations

import re
import urllib.parse
from typing import Iterator, Optional

# TensorStore's status texts for a failed request to a store: 'CODE: ...
# [http_response_code='403']'.
_TS_STATUS = re.compile(r'^([A-Z_]{6,}): ')
_HTTP_CODE = re.compile(r"http_response_code='?(\d{3})")
_HTTP_REASONS = {400: 'Bad Request', 401: 'Unauthorized', 403: 'Forbidden',
                 404: 'Not Found', 408: 'Request Timeout',
                 412: 'Precondition Failed', 429: 'Too Many Requests',
                 500: 'Internal Server Error', 502: 'Bad Gateway',
                 503: 'Service Unavailable', 504: 'Gateway Timeout'}
_STORE_HINTS = {
    401: 'check the credentials (gcloud auth application-default login, '
         'or GOOGLE_APPLICATION_CREDENTIALS)',
    403: 'check that the credentials may write the bucket (an expired or '
         'read-only credential, a bucket policy)',
    404: 'check that the bucket exists',
    429: 'the store kept throttling after every retry',
}

_BUCKET_HINT = ('check the bucket\'s name, that it exists and that these '
                'credentials may see it')

# gcsfs names a failed request by its path: 'b/BUCKET/o/NAME' (NAME
# URL-quoted) for an object, 'b/BUCKET/o' for a listing, or the whole URL
# (http(s)://HOST/upload/storage/v1/b/BUCKET/o?name=NAME) for an upload.
_GCS_REQUEST = re.compile(
    r'(?:^|/storage/v1/)b/([^/?\s]+)(?:/o(?:/([^?\s]+))?)?(?:\?(\S*))?$')


def _gcs_request(e: BaseException) -> Optional[tuple[str, str, bool]]:
  """``(bucket, object name or '', whether an upload)`` of the gcsfs
  request a ``FileNotFoundError`` names (its HTTP 404), or None."""
  if not isinstance(e, FileNotFoundError) or e.errno is not None:
    return None
  match = _GCS_REQUEST.search(' '.join(str(e).split()))
  if not match:
    return None
  bucket, name, query = match.groups()
  name = urllib.parse.unquote(name or '') or urllib.parse.parse_qs(
      query or '').get('name', [''])[0]
  return (urllib.parse.unquote(bucket), name,
          '/upload/storage/' in str(e))


def gcs_url(e: BaseException) -> Optional[str]:
  """``gs://BUCKET/NAME`` of the gcsfs request a ``FileNotFoundError``
  names, or None."""
  request = _gcs_request(e)
  if request is None:
    return None
  bucket, name, _ = request
  return f'gs://{bucket}/{name}' if name else f'gs://{bucket}'


def missing_bucket(e: BaseException) -> Optional[str]:
  """``bucket 'B' does not exist or cannot be reached (gs://B/NAME)`` when
  ``e`` is gcsfs's 404 for a request that only a missing bucket answers so:
  an upload, or the listing of a prefix (a bucket that exists lists
  nothing, with 200). A read of an object answers 404 for a missing object
  too, so it is no proof; None then."""
  request = _gcs_request(e)
  if request is None:
    return None
  bucket, name, upload = request
  if name and not upload:
    return None
  return (f"bucket '{bucket}' does not exist or cannot be reached "
          f'({gcs_url(e)})')


def _http_status(code: int, detail: str = '') -> str:
  text = f'HTTP {code} {_HTTP_REASONS.get(code, "")}'.rstrip()
  detail = ' '.join(detail.split())[:160]
  return f'{text} ({detail})' if detail else text


def _answer_of(e: BaseException) -> Optional[tuple[str, str]]:
  """``(the store's answer, what to do)`` when ``e`` itself is a failed
  request to an object store, else None."""
  module = type(e).__module__ or ''
  name = type(e).__name__
  text = ' '.join(str(e).split())
  code = getattr(e, 'code', None)
  if name == 'HttpError' and module.startswith('gcsfs') and isinstance(
      code, int):  # gcsfs after its retries
    words = str(getattr(e, 'message', '') or '')
    words = words[:-len(f', {code}')] if words.endswith(f', {code}') else words
    return _http_status(code, words), _STORE_HINTS.get(code, '')
  if isinstance(e, OSError) and text.startswith('Forbidden: '):  # gcsfs 403
    return _http_status(403, str(e).split('\n', 1)[-1]), _STORE_HINTS[403]
  if isinstance(e, FileNotFoundError):
    missing = missing_bucket(e)
    if missing is not None:
      return missing, _BUCKET_HINT
    if '/storage/v1/b/' in text:
      return _http_status(404, f'no such object: {gcs_url(e) or text}'), (
          _STORE_HINTS[404])
  if module.startswith('aiohttp') or name in ('EndpointConnectionError',
                                              'ConnectTimeoutError'):
    return (f'the store could not be reached ({name}: {text[:120]})',
            'check the network and the store, then run again')
  if module.startswith('botocore') and isinstance(
      getattr(e, 'response', None), dict):  # ClientError and its subclasses
    err = e.response.get('Error', {})
    if err.get('Code') == 'NoSuchBucket':
      bucket = err.get('BucketName')
      return (f"bucket '{bucket}' does not exist or cannot be reached "
              f'(s3://{bucket})' if bucket else
              'the bucket does not exist or cannot be reached'), _BUCKET_HINT
  if name == 'ClientError' and module.startswith('botocore'):
    err = getattr(e, 'response', {}).get('Error', {})
    meta = getattr(e, 'response', {}).get('ResponseMetadata', {})
    status = meta.get('HTTPStatusCode')
    detail = f"{err.get('Code', '')}: {err.get('Message', '')}"
    return ((_http_status(status, detail) if isinstance(status, int)
             else detail), _STORE_HINTS.get(status, ''))
  if 'Malformed StorageGeneration' in text:
    return ('the server answered without the x-goog-generation header '
            '(TensorStore: Malformed StorageGeneration)',
            'real GCS sends it; the bare gcp-storage-emulator does not: '
            'use tests/gcs_server.py (docs/training.md#trying-the-pod-path-'
            'on-one-machine)')
  if isinstance(e, TimeoutError) and 'async_write_complete' in text:
    return ('the hosts timed out waiting for each other\'s checkpoint '
            'writes', 'another host failed first: see its error line')
  if 'CURL error' in text:  # TensorStore after its retries
    curl = text[text.index('CURL error'):].split(' [')[0][:120]
    return (f'the store could not be reached ({curl})',
            'check the network and the store, then run again')
  status = _TS_STATUS.match(text)
  http = _HTTP_CODE.search(text)
  if status and (http or 'gs://' in text or 's3://' in text):
    detail = re.split(r' \[http_response_', text[len(status.group(0)):])[0]
    if http:
      code = int(http.group(1))
      return (_http_status(code, detail.rsplit(': ', 1)[-1]),
              _STORE_HINTS.get(code, ''))
    return (f'{status.group(1)} ({detail[:160]})',
            'check the network and the store, then run again')
  return None


def store_fault(exc: BaseException) -> Optional[tuple[str, str]]:
  """``(answer, hint)`` for the first failed object-store request in
  ``exc``'s chain (cause, context, exception-group members): gcsfs's and
  s3fs's errors after their retries, TensorStore's status texts (through
  Orbax), an unreachable store. ``answer`` names the HTTP status and the
  store's words; ``hint`` what to do (may be empty). None otherwise."""
  for e in chain(exc):
    found = _answer_of(e)
    if found is not None:
      return found
  return None


def chain(exc: BaseException) -> Iterator[BaseException]:
  """``exc``, then its exception-group members, cause and context, each
  once, breadth first."""
  seen: set[int] = set()
  todo = [exc]
  while todo:
    e = todo.pop(0)
    if e is None or id(e) in seen:
      continue
    seen.add(id(e))
    yield e
    todo.extend(getattr(e, 'exceptions', ()) or ())
    todo.extend([e.__cause__, e.__context__])
