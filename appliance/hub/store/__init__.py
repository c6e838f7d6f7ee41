"""Work that outlives a request: files, batches, stored responses and conversations.

`db.py` is the SQLite tables (plain, synchronous); `store.py` runs them off the trio loop
(WAL, one connection, one thread at a time) with the files on disk beside them and the
bounds; `ids.py` makes and reads object ids (each names the hub that holds it);
`lines.py` checks a batch's lines and renders results in each API's shape; `runner.py`
runs batches through the router as background work and resumes them after a restart;
`outputs.py` writes a finished batch's files; `items.py` and `responses.py` keep stored
responses, chains, conversations and background responses. The routes are hub/api's.
"""
