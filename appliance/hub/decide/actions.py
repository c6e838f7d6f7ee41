"""What the control plane's core asks its shell to do, and what it remembers doing.

Owns the actions placement.py returns -- `Load` (a replica onto a node, after unloading
its `victims`) and `Unload` -- and `Pending`, a load being carried out (its memory held
against placement until the node's state shows it). Plain data: control.py carries the
actions out, placement.py decides them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from appliance.wire import LoadRequest


@dataclass
class Pending:
    """A load the shell is carrying out (or one the node answered and has yet to show)."""

    model: str
    node: str
    need: int
    settle_until: float | None = None
    victims: tuple[str, ...] = ()


@dataclass
class Load:
    model: str
    node: str
    request: LoadRequest
    victims: list[str] = field(default_factory=list)  # models to unload from `node` first


@dataclass
class Unload:
    model: str
    node: str
    why: str


Action = Load | Unload
