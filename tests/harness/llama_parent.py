"""A node-like parent for the SIGKILL tests: runs a LlamaCppEngine, loads one model,
prints the engine process's pid, and waits to be killed.

    python tests/harness/llama_parent.py ENGINE_COMMAND MODEL_FILE
"""

import sys

import trio

from appliance import config
from appliance.node.engines.llamacpp import LlamaCppEngine


async def main() -> None:
    eng = LlamaCppEngine(config.load({"Engine__Kind": "llamacpp", "Engine__Command": sys.argv[1]}))
    async with trio.open_nursery() as n:
        await n.start(eng.run)
        await eng.load("m", sys.argv[2])
        print(eng.pid("m"), flush=True)
        await trio.sleep_forever()


trio.run(main)
