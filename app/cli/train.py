"""`understudy train-drafter`: train a drafter head for a model, in the background.

The engine does the work (engine/training/job.py); this front end picks the data source
(reading chat history from the app's store when asked), prints one line per slice worth
showing, and turns Ctrl-C into a clean stop that still writes a checkpoint.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading


def add_parser(sub) -> None:
    p = sub.add_parser("train-drafter",
                       help="train a drafter head for a model on this machine (resumable)")
    p.add_argument("--model", default="demo",
                   help="model folder, HF repo id in the local HF cache, or 'demo' (default)")
    p.add_argument("--minutes", type=float, default=60.0,
                   help="time budget for this run (default 60); run again to continue")
    p.add_argument("--data", default="builtin",
                   help="builtin (bundled prompts), history (your chats), or a JSON-lines "
                   "file of {prompt} / {messages}")
    p.add_argument("--seed", type=int, default=0,
                   help="seed for the head's initial weights and the order of the data")
    p.add_argument("--hot-vocab", type=int, default=8192,
                   help="size of the head's output vocabulary (the most used tokens)")
    p.add_argument("--max-data-mb", type=float, default=2048.0,
                   help="disk the training data may use, in MB (default 2048); reached, "
                   "the run trains on the data it has")
    p.add_argument("--max-steps", type=int, default=None, help=argparse.SUPPRESS)


def _history() -> tuple[tuple[dict[str, str], ...], ...]:
    """Every conversation in the app's history, as role/content messages."""
    from app.store import Store

    store = Store()
    if store.repair is not None:
        print(f"warning: {store.repair.message()}", file=sys.stderr)
    try:
        return tuple(
            tuple({"role": m.role, "content": m.content}
                  for m in store.messages(c.id, with_steps=False))
            for c in store.conversations())
    finally:
        store.close()


def run(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from engine.drafters.head_io import head_root
    from engine.loading import load_model
    from engine.training.fit import FitOptions
    from engine.training.job import TrainOptions, check_data, train_drafter

    conversations = _history() if args.data == "history" else ()
    options = TrainOptions(minutes=args.minutes, data=args.data, conversations=conversations,
                           hot_vocab=args.hot_vocab, max_steps=args.max_steps,
                           max_data_mb=args.max_data_mb,
                           fit=replace(FitOptions(), seed=args.seed))
    target = load_model(args.model)  # after the options: a bad flag is said at once

    def warn(line: str) -> None:
        print(f"warning: {line}", file=sys.stderr)

    # a bad data source is one error line before anything starts
    n_items, n_online = check_data(target, options, warn=warn)
    print(f"training a drafter head for {target.name} for up to {args.minutes:g} min "
          f"(data: {args.data}); folder {head_root(target.path)}", file=sys.stderr)
    if args.data == "history":
        print(f"history: {n_online} positions recorded while chatting (online buffer), "
              f"{n_items} stored replies to read", file=sys.stderr)
    cancel = threading.Event()
    last = None
    made_data = False
    printed_sequences = -1

    def interrupted(_signum, _frame) -> None:
        """Ctrl-C: finish the slice, write a checkpoint, stop. Not a KeyboardInterrupt:
        raised inside the job's generator, that ended the job where it stood, so the
        steps since the last checkpoint were lost and the end said "no head yet"."""
        if cancel.is_set():
            raise KeyboardInterrupt  # a second Ctrl-C: out at once
        cancel.set()
        print("stopping after a checkpoint... (Ctrl-C again to quit now)", file=sys.stderr)

    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, interrupted) if main_thread else None
    try:
        for p in train_drafter(target, options, cancel, warn=warn):
            last = p
            made_data = made_data or p.phase == "data"
            if p.phase == "data":
                # once the data on hand is known and after each batch, not every slice
                if p.data_sequences and p.data_sequences != printed_sequences:
                    printed_sequences = p.data_sequences
                    print(f"data   {p.data_sequences:5d} replies {p.data_tokens:7d} tokens  "
                          f"{p.elapsed_s:6.0f}s", file=sys.stderr)
            elif p.phase == "done" and not p.new_checkpoint:
                continue  # no step was trained: said once below
            elif p.phase in ("checkpoint", "done") or p.step % 25 == 0:
                top1 = (f"  held-out top-1 {p.heldout_top1:.3f}"
                        if p.heldout_top1 is not None else "")
                loss = p.loss if p.loss is not None else 0
                print(f"{p.phase:<6} step {p.step:6d}  loss {loss:7.3f}"
                      f"  tokens {p.tokens_seen:8d}{top1}  {p.elapsed_s:6.0f}s", file=sys.stderr)
    finally:
        if main_thread:
            signal.signal(signal.SIGINT, previous)
    if last is not None and last.new_checkpoint:
        print(f"head saved: {last.checkpoint}")
    elif last is not None and last.checkpoint:
        spent = (f"the time went to making data ({last.data_sequences} replies, kept)"
                 if made_data else "the time ran out before the first step")
        print(f"no training steps ran this time: {spent}; the head in use stays "
              f"{last.checkpoint}. Run again to train on", file=sys.stderr)
    elif last is not None:
        print(f"no head yet: the time went to making data ({last.data_sequences} replies, "
              "kept); run again to train from it", file=sys.stderr)
    return 0
