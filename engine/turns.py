"""Several replies decoded side by side on one thread, taking turns, each timed on its own.

Both `understudy bench` and the app's speculative-vs-plain race need two decoders to see
the same machine: whole replies one after the other sit seconds apart on a shared
machine, and their speed ratio swings by several percent with the load. Turns of about a
second see the same load, and swapping places every round (ABBA) cancels a load that
drifts within a round. MLX work is asynchronous, so a turn is timed until the work it
queued has finished (`mx.synchronize`): no stream is charged for another's passes.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import mlx.core as mx

from engine.events import Finished, PromptProgress, Step


@dataclass(frozen=True)
class TurnEvent:
    """One stream's event, and that stream's decode seconds so far (its own turns only)."""

    name: str
    event: PromptProgress | Step | Finished
    own_s: float


def take_turns(streams: Mapping[str, Iterator], turn_over: Callable[[int, float], bool],
               ) -> Iterator[TurnEvent]:
    """Drive `streams` (name -> a ChatSession's event iterator) to their `Finished` events.

    Each stream first reads its prompt, in the order given (prompt time is the stream's
    own Stats, not part of the turns). Then rounds of turns: a stream runs until
    `turn_over(steps in this turn, seconds in this turn)` says stop, or it finishes; the
    order reverses every round. A `Finished` event is passed on after its turn's timing
    is closed, so its `own_s` is the stream's whole decode time.
    """
    names = list(streams)
    live: dict[str, Iterator] = {}
    for name in names:
        events = iter(streams[name])
        for ev in events:
            if isinstance(ev, PromptProgress):
                yield TurnEvent(name, ev, 0.0)
                if ev.done < ev.total:
                    continue
                live[name] = events
            else:  # no progress events at all (or one that skipped them): decode at once
                live[name] = itertools.chain([ev], events)
            break
        else:
            raise RuntimeError(f"{name}: the reply ended without a Finished event")
    mx.synchronize()
    own = dict.fromkeys(names, 0.0)
    rounds = 0
    while live:
        rounds += 1
        for name in names if rounds % 2 else reversed(names):
            if name not in live:
                continue
            t0 = time.perf_counter()
            steps = 0
            finished: Finished | None = None
            for ev in live[name]:
                if isinstance(ev, Finished):
                    finished = ev
                    break
                yield TurnEvent(name, ev, own[name] + time.perf_counter() - t0)
                if isinstance(ev, Step):
                    steps += 1
                    if turn_over(steps, time.perf_counter() - t0):
                        break
            else:
                raise RuntimeError(f"{name}: the reply ended without a Finished event")
            mx.synchronize()
            own[name] += time.perf_counter() - t0
            if finished is not None:
                del live[name]
                yield TurnEvent(name, finished, own[name])
