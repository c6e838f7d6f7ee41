"""What the tests share: the fleet of real processes, the listeners, the engines' stand-ins.

`ROOT` is the repository, `HARNESS` this folder (its scripts run as child processes).
"""

from pathlib import Path

HARNESS = Path(__file__).resolve().parent
ROOT = HARNESS.parent.parent
