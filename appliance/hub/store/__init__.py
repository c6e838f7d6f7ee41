"""Work that outlives a request: files, batches, stored responses and conversations.

`db.py` is the SQLite store (WAL, one connection, run off the trio loop by `Store`), with
uploaded files on disk beside it; `ids.py` makes and reads the object ids (each names the
hub that holds it); `upload.py` streams a multipart upload to disk within its bounds;
`runner.py` runs batches on the fleet as background work and resumes them after a restart.
"""
