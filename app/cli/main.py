"""The `understudy` command: no arguments opens the GUI; subcommands work headless.

Engine imports are deferred until after `ensure_openblas`, which may re-exec the process
with the fast BLAS preloaded; an `EngineError` is printed in one line and exits 1.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
from contextlib import closing, suppress
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from app.bounded_exit import exit_code, exit_now
from app.cli.launcher import ensure_openblas
from engine.choices import ACCEPT_RULES, DRAFTERS, TREE_MODES

if TYPE_CHECKING:  # (imported where used: the engine loads after `ensure_openblas`)
    from engine.decode import GenerateOptions
    from engine.events import Stats


class HelpFormatter(argparse.HelpFormatter):
    """Each option's help line ends with its default, as `ArgumentDefaultsHelpFormatter`
    does, except where there is none to show (None, off, an empty list) or the line
    already says it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = (action.help or "").strip()
        default = action.default
        if (not action.option_strings or "default" in text or default is None
                or default is False or default == [] or default is argparse.SUPPRESS):
            return text
        return f"{text} (default: %(default)s)".lstrip()


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose command parsers, to any depth, format help with
    `HelpFormatter` (`add_subparsers` makes them of the parent's class)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        action = super().add_argument(*args, **kwargs)
        # an option added without a help line still shows its default (argparse prints
        # nothing after an option whose help is empty)
        if action.help is None and action.option_strings:
            shown = HelpFormatter("")._get_help_string(action)
            action.help = shown or None
        return action


def _add_model_args(p: argparse.ArgumentParser,
                    drafter_help: str = "speculative drafter (default: auto, the drafters "
                    "weighed by their measured costs and acceptance; none = plain decoding)",
                    ) -> None:
    p.add_argument("--model", default="demo",
                   help="model folder, HF repo id in the local HF cache, or 'demo' (default)")
    p.add_argument("--draft", default=None, help="draft model for --drafter model/auto")
    # auto, as in the app and `serve`: the text is plain decoding's either way (the coupled
    # rule), and auto drafts only where its measurements say a draft pays
    p.add_argument("--drafter", default="auto",
                   choices=DRAFTERS,
                   help=drafter_help)
    p.add_argument("--k", default="auto",
                   help="draft length: 'auto' (adaptive) or a number of tokens")
    p.add_argument("--accept", default="coupled", choices=ACCEPT_RULES,
                   help="lossless acceptance rule")
    p.add_argument("--tree", default="auto", choices=TREE_MODES,
                   help="draft trees: auto (where the measured costs say a tree pays; "
                   "coupled rule only) or off (chains)")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--system", default=None, metavar="TEXT", help="system prompt (default: none)")
    p.add_argument("--max-tokens", type=int, default=512,
                   help="most tokens to write in one reply")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature; 0 picks the most likely token (greedy)")
    p.add_argument("--top-k", type=int, default=0,
                   help="sample from the K most likely tokens only; 0 = no limit")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="sample from the smallest set of tokens whose probabilities add up "
                   "to P (nucleus sampling); 1 = no limit")
    p.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens less likely than P times the most likely one; 0 = off")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="make tokens already in the text less likely; 1 = off")
    p.add_argument("--seed", type=int, default=None,
                   help="random seed for sampling at temperature > 0 (default: a new "
                   "random seed each run, reported in the stats so --seed N repeats the "
                   "run)")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop the reply where this text appears (repeatable; not empty)")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="understudy",
        description="Local LLM chat with visible speculative decoding. "
        "Run without arguments to open the app.",
    )
    parser.add_argument("--smoke", action="store_true",
                        help="open the app offscreen, answer one message on the demo model "
                        "(or --model's), quit (status 0 when it worked)")
    # dest differs from the subcommands' --model, whose default would overwrite this one
    parser.add_argument("--model", dest="gui_model", default=None, metavar="MODEL",
                        help="open the app on this model (a folder, an HF repo id in the local "
                        "cache, or 'demo'); default: the model last used")
    sub = parser.add_subparsers(dest="command")

    gen = sub.add_parser("generate", help="generate one reply and stream it to stdout")
    _add_model_args(gen)
    src = gen.add_mutually_exclusive_group()
    src.add_argument("text", nargs="?", metavar="PROMPT",
                     help="the user message (read from standard input when piped and none "
                     "is given)")
    src.add_argument("--prompt", metavar="TEXT", help="the user message")
    src.add_argument("--messages", type=Path, metavar="FILE",
                     help="JSON file: a list of {role, content} messages (roles: "
                     "system, developer, user, assistant)")
    _add_sampling_args(gen)
    gen.add_argument("--prediction", type=Path, metavar="FILE",
                     help="text the reply is expected to repeat (the file being edited, "
                     "an earlier reply): prompt lookup drafts from it; the reply is the same "
                     "with or without it")
    gen.add_argument("--json", action="store_true",
                     help="print one JSON object at the end instead of streaming text")

    chat = sub.add_parser("chat", help="interactive chat in the terminal")
    _add_model_args(chat)
    _add_sampling_args(chat)
    chat.add_argument("--learn", action="store_true",
                      help="keep each reply's features on disk (app-data dir, bounded) so "
                      "`train-drafter --data history` learns from this chat (off by default)")

    imp = sub.add_parser("import-gguf", help="convert a GGUF (llama, qwen2, qwen3, qwen3moe, gemma3, phi3) into an HF-style folder")
    imp.add_argument("file", type=Path, help="the .gguf file to convert")
    imp.add_argument("dest", type=Path,
                     help="the model folder to write (must not exist yet); then use it "
                     "with --model DEST")

    bench = sub.add_parser("bench", help="measure plain vs speculative decoding")
    _add_model_args(bench, "the spec mode's drafter (default: auto, the drafters weighed "
                    "by their measured costs and acceptance)")
    bench.add_argument("--prompts", type=Path, default=None, metavar="FILE",
                       help="JSON lines {id, category, messages}; default: the bundled set")
    bench.add_argument("--modes", default="plain,spec",
                       help="plain,spec; add 'chain' (spec with --tree off) to measure draft "
                       "trees against chains in the same run")
    bench.add_argument("--max-tokens", type=int, default=128,
                       help="most tokens to write per reply")
    bench.add_argument("--temperature", type=float, default=0.0,
                       help="sampling temperature; 0 = greedy")
    # fixed, unlike generate's: every mode samples with the same seed, and runs repeat
    bench.add_argument("--seed", type=int, default=0,
                       help="random seed for sampling at temperature > 0, the same for "
                       "every mode")
    bench.add_argument("--limit", type=int, default=None,
                       help="use only the first N prompts (N >= 1; default: all)")
    bench.add_argument("--category", action="append", default=[],
                       help="only prompts of this category (repeatable)")
    bench.add_argument("--compare-mlx-lm", action="store_true",
                       help="also time mlx-lm's plain decoding of the same model (if installed)")
    bench.add_argument("--json", type=Path, default=None, metavar="PATH",
                       help="also write the report to this JSON file (checked before the run)")

    doctor = sub.add_parser("doctor", help="check this machine: backend, BLAS, Metal kernels")
    doctor.add_argument("--recheck", action="store_true",
                        help="test the kernels again (even ones that failed on this setup)")

    try:
        from app.cli import models as models_cli
    except ImportError:
        models_cli = None
    if models_cli is not None:
        models_cli.add_parser(sub)
    from app.server.run import add_parser as add_serve_parser

    add_serve_parser(sub)
    from app.cli.train import add_parser as add_train_parser

    add_train_parser(sub)
    return parser


def _messages(args: argparse.Namespace) -> list[dict[str, str]]:
    from engine.errors import PromptError
    from engine.tokenizer import check_messages

    if getattr(args, "messages", None) is not None:
        try:
            data = json.loads(args.messages.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise PromptError(f"{args.messages}: no such file") from None
        except (OSError, ValueError) as e:
            raise PromptError(f"{args.messages}: not valid JSON ({e})") from None
        if isinstance(data, dict) and "messages" in data:
            data = data["messages"]
        messages = list(check_messages(data, str(args.messages)))
        if args.system and messages[0]["role"] == "system":
            raise PromptError(f"--system: {args.messages} already starts with a system "
                              "message; give the system prompt in one place")
    else:
        messages = [{"role": "user", "content": _prompt_text(args)}]
    if args.system:
        messages.insert(0, {"role": "system", "content": args.system})
    return messages


def _message_source(args: argparse.Namespace) -> str | None:
    """Where the message came from when it is not standard input (None when it is)."""
    if getattr(args, "messages", None) is not None:
        return "--messages"
    if args.prompt is not None:
        return "--prompt"
    return "the argument" if getattr(args, "text", None) is not None else None


def _stdin_waiting() -> bool:
    """Whether standard input holds text nobody will read, found without reading it
    (reading would take it from a script's loop that feeds this command's caller)."""
    import fcntl
    import stat
    import termios

    try:
        fd = sys.stdin.fileno()
        mode = os.fstat(fd).st_mode
        if stat.S_ISREG(mode):
            return os.fstat(fd).st_size > os.lseek(fd, 0, os.SEEK_CUR)
        if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
            waiting = bytearray(4)
            fcntl.ioctl(fd, termios.FIONREAD, waiting)
            return int.from_bytes(waiting, sys.byteorder) > 0
    except (AttributeError, OSError, ValueError):  # no stdin, or one that cannot say
        pass
    return False


def _warn_unread_stdin(args: argparse.Namespace) -> None:
    """`echo text | understudy generate --messages chat.json`: the piped text is not part
    of the conversation; say so rather than drop it silently."""
    source = _message_source(args)
    if source is not None and _stdin_waiting():
        print(f"warning: standard input is not read: the message comes from {source}",
              file=sys.stderr)


def _prompt_text(args: argparse.Namespace) -> str:
    """The user message: the argument, --prompt, or what was piped in (`cat notes.txt |
    understudy generate`), as other command-line LLM tools take it."""
    from engine.errors import PromptError

    text = args.prompt if args.prompt is not None else getattr(args, "text", None)
    if text is not None:
        return text
    _lenient_stdin()
    piped = "" if sys.stdin is None or sys.stdin.isatty() else sys.stdin.read()
    if piped.strip():
        return piped
    where = "standard input was empty; " if piped else ""
    raise PromptError(f"no message: {where}give it as an argument, --prompt TEXT, "
                      "--messages FILE.json or on standard input")


def _seed(args: argparse.Namespace) -> int:
    """--seed, or a fresh random one when sampling (temperature > 0) without it, as
    llama.cpp and the OpenAI API do: two runs then differ, and the stats report the seed
    so `--seed N` repeats a run. Greedy decoding uses no randomness (0)."""
    if args.seed is not None:
        return args.seed
    if args.temperature > 0:
        import secrets

        return secrets.randbelow(2**31)
    return 0


def _options(args: argparse.Namespace):
    from engine.decode import GenerateOptions
    from engine.errors import EngineError
    from engine.sampling import SamplingParams

    if args.k == "auto":
        k = None
    else:
        try:
            k = int(args.k)
        except ValueError:
            raise EngineError(f"--k must be 'auto' or a number, got {args.k!r}") from None
    sampling = SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        repetition_penalty=args.repetition_penalty, seed=_seed(args),
    )
    return GenerateOptions(max_tokens=args.max_tokens, sampling=sampling, stop=tuple(args.stop),
                           drafter=args.drafter, k=k, accept=args.accept, tree=args.tree)


def _session(args: argparse.Namespace):
    from engine.decode import ChatSession
    from engine.loading import load_model

    target = load_model(args.model)  # a missing chat template: a ChatTemplateWarning line
    draft = load_model(args.draft) if args.draft else None
    from engine.drafters.head_io import head_for_drafter

    return ChatSession(target, draft, head_for_drafter(target, args.drafter))



def _tail(text: str, n: int = 60) -> str:
    """The end of a reply that /continue goes on from, marked as an excerpt where it is
    cut (unmarked, it read as the reply printed twice)."""
    return text if len(text) <= n else "\N{HORIZONTAL ELLIPSIS}" + text[-n:]


def _stream(session, messages, options, out: Any = None, continue_final: bool = False,
            steps: list | None = None) -> Any:
    """Run one reply (or, `continue_final`, the rest of the last one), writing text to
    `out` as it arrives (None: nowhere); returns (Finished, steps). `steps` collects them
    as they come, so a caller stopped by Ctrl-C still has what was written."""
    from engine.events import Finished, Step

    finished = None
    steps = [] if steps is None else steps
    # closing(): on Ctrl-C (chat) or a broken pipe the loop's cleanup — trimming the KV
    # cache to what was committed — runs now, not whenever the generator is collected.
    with closing(session.generate(messages, options, continue_final=continue_final)) as events:
        for ev in events:
            if isinstance(ev, Step):
                steps.append(ev)
                if ev.error and all(ev.error != s.error for s in steps[:-1]):
                    # the step log: a drafter's malformed draft, refused (once per kind)
                    print(f"\n[step {len(steps)}: {ev.error}]", file=sys.stderr)
                if out is not None:
                    out.write(ev.text)
                    out.flush()
            elif isinstance(ev, Finished):
                finished = ev
    return finished, steps


def _prompt_read(stats) -> str:
    """The chat stats line's prompt time: the wait before the first token, and how much of
    the prompt the cache already held (all of an earlier turn, or a conversation come back
    to: `engine.prefix_store`)."""
    cached = stats.cached_tokens
    held = f" ({cached:,} of {stats.prompt_tokens:,} tokens cached)" if cached else ""
    return f"prompt {stats.prompt_s:.2f} s{held}"


def _dropped(stats) -> str:
    """The stats line's note on messages left out to fit the context window, if any."""
    from engine.context_fit import dropped_note

    note = dropped_note(stats.dropped_messages)
    return f" · {note}" if note else ""


def _seed_note(options) -> str:
    """The stats line's seed, where one was sampled with (so the run can be repeated)."""
    sampling = options.sampling
    return f" · seed {sampling.seed}" if sampling.temperature > 0 else ""


def cmd_generate(args: argparse.Namespace) -> int:
    from engine.prediction import prediction_use

    messages = _messages(args)
    options = replace(_options(args), reference=_prediction_text(args.prediction))
    session = _session(args)
    _warn_unread_stdin(args)  # after loading: by now a pipe's writer has written
    finished, steps = _stream(session, messages, options, None if args.json else sys.stdout)
    used = (prediction_use(session.target.tokenizer.encode(options.reference),
                           finished.token_ids) if args.prediction is not None else None)
    if args.json:
        tokens = [{"id": t.id, "text": t.text, "kind": t.kind.value}
                  for s in steps for t in s.tokens if t.kind.committed]
        stats = {**finished.stats.as_dict(), "seed": options.sampling.seed}
        if used is not None:
            stats["prediction"] = {"accepted_tokens": used.accepted,
                                   "rejected_tokens": used.rejected}
        print(json.dumps({"text": finished.text, "tokens": tokens, "stats": stats},
                         ensure_ascii=False))
    else:
        s = finished.stats
        sys.stdout.write("\n")
        predicted = (f" · {used.accepted} of {used.accepted + used.rejected} predicted "
                     "tokens written" if used is not None else "")
        print(f"[{s.generated_tokens} tokens · {s.decode_tps:.1f} tok/s · prompt "
              f"{s.prompt_tps:.1f} tok/s · {s.tau:.2f} tokens/pass · "
              f"{100 * s.acceptance:.0f}% accepted{predicted} · {s.finish_reason}"
              f"{_dropped(s)}{_seed_note(options)}]", file=sys.stderr)
        note = _nothing_drafted(options, s)
        if note:
            print(note, file=sys.stderr)
    return 0


def _nothing_drafted(options: GenerateOptions, stats: Stats) -> str:
    """Why a reply that asked for a drafter drafted nothing ("" when it drafted): without
    it, `--drafter model` reading "1.00 tokens/pass · 0% accepted" looks broken."""
    if options.drafter == "none" or stats.n_drafted or stats.generated_tokens < 2:
        return ""
    if options.drafter == "ngram":
        return ("(nothing drafted: prompt lookup found no earlier text that this reply "
                "repeats)")
    return (f"(nothing drafted: drafting with '{options.drafter}' was judged slower than plain "
            "steps here, from the measured pass costs and how often drafts were accepted; "
            "--k N drafts N tokens a step regardless)")


def _prediction_text(path: Path | None) -> str:
    """The text of --prediction FILE ("" without one), or an error naming the file."""
    from engine.errors import PromptError

    if path is None:
        return ""
    try:
        return path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise PromptError(f"--prediction: {path}: no such file") from None
    except IsADirectoryError:
        raise PromptError(f"--prediction: {path} is a folder, not a text file") from None
    except UnicodeDecodeError as e:
        raise PromptError(f"--prediction: {path} is not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise PromptError(f"--prediction: cannot read {path} ({e.strerror})") from None


def cmd_chat(args: argparse.Namespace) -> int:
    options = _options(args)
    session = _session(args)
    if not args.learn:
        return _chat_loop(args, session, options)
    from engine.training.online import open_buffer

    buffer = open_buffer(session.target.path, session.feature_layers,
                         on_problem=lambda line: print(f"warning: {line}", file=sys.stderr))
    session.set_online(buffer)
    try:
        return _chat_loop(args, session, options)
    finally:
        buffer.close()  # the last reply's positions reach the disk before the process ends


QUIT_COMMANDS = ("/bye", "/quit", "/exit")
HELP_COMMANDS = ("/help", "/?")
CHAT_COMMANDS = (*QUIT_COMMANDS, *HELP_COMMANDS, "/continue", "/retry", "/reset")
FENCE = '"""'
CHAT_HELP = f"""commands:
  /continue           write on from the end of the last reply (one cut at --max-tokens)
  /retry              write the last reply again (at a temperature above 0 with the next
                      seed), drafted from the one it replaces
  /reset              start a new conversation (the system prompt stays)
  /bye, /quit, /exit  leave (so does Ctrl-D)
  /help               this list
  //word              send "/word" as a message (a line of one /word is read as a command)
  {FENCE}                 on a line of its own, starts a message of several lines (pasted
                      code, blank lines and all); another {FENCE} line ends it
Ctrl-C stops a reply as it is written; what it wrote stays (/continue goes on from it).
At the prompt, Ctrl-C drops what you were typing (a {FENCE} block too)."""


def _lenient_stdin() -> None:
    """Bytes that are not UTF-8 in what is typed or piped in (a Latin-1 file, say) read as
    U+FFFD: strict decoding stopped with a traceback, and the C locale's surrogate escapes
    crashed the tokenizer with one."""
    if isinstance(sys.stdin, io.TextIOWrapper):
        sys.stdin.reconfigure(errors="replace")


def _reads_a_terminal() -> bool:
    """Whether to prompt: piped input (a script, a file) gets no "you> " or "... " in the
    output, as Python's REPL and sqlite3 do, so stdout holds only the replies."""
    return sys.stdin is not None and sys.stdin.isatty()


def _line_editing() -> None:
    """Line editing for input() at a terminal. Without it the kernel's line discipline reads
    the line: arrow keys land in the message as escape codes ("^[[D") and a pasted line
    is cut at 4,095 characters without a word; readline reads it raw, with no limit, and
    gives history (Up) too. Absent on some platforms (Windows): the plain line stays."""
    with suppress(ImportError):
        import readline  # noqa: F401  (importing it is what hooks input())


def _read_message(prompts: bool = True) -> tuple[str, bool]:
    """One message from the terminal and whether it is literal text: a line, or the lines
    between two lines holding just triple quotes (literal: never a command), so pasted
    code keeps its blank lines instead of becoming many turns. The end of input closes an
    open block, so piped text whose closing quotes are missing is still sent, not lost."""
    line = input("you> " if prompts else "")
    if line.strip() != FENCE:
        return line, False
    lines: list[str] = []
    try:
        while (more := input("... " if prompts else "")).strip() != FENCE:
            lines.append(more)
    except EOFError:
        if not "".join(lines).strip():
            raise
        if prompts:
            print(file=sys.stderr)  # Ctrl-D leaves the cursor after "... "
    return "\n".join(lines), True


def _as_command(line: str) -> tuple[str | None, str]:
    """(command, message) for a typed line: a known command, or the message to send.

    A line of one word starting with "/" and no other "/" is a command, so a typo (/exti)
    is refused rather than sent to the model; a longer line ("/usr/bin is…") or a path
    (/usr/bin/env) is a message, and "//word" sends "/word". An unknown command comes back
    as the command, for the caller to refuse."""
    word = line.strip()
    if not word.startswith("/") or len(word.split()) != 1:
        return None, line
    if word.startswith("//"):
        return None, word[1:]
    if word in CHAT_COMMANDS or "/" not in word[1:]:
        return word, line
    return None, line


def _chat_loop(args: argparse.Namespace, session, options) -> int:
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    print('Understudy chat — /bye or Ctrl-D to quit, /reset to start over, """ for a '
          "message of several lines, /help for more.", file=sys.stderr)
    if options.sampling.temperature > 0:
        seed = options.sampling.seed
        print(f"sampling at temperature {options.sampling.temperature:g} with seed {seed} "
              f"(--seed {seed} repeats this chat)", file=sys.stderr)
    from engine.errors import EngineError

    _lenient_stdin()
    retries = 0
    prompts = _reads_a_terminal()
    if prompts:
        _line_editing()
    while True:
        try:
            line, literal = _read_message(prompts)
        except KeyboardInterrupt:
            if not prompts:
                return 0
            # what was being typed goes, as in a shell or Python's REPL; the chat stays (a
            # Ctrl-C meant to stop a reply that had just ended no longer loses it)
            print(file=sys.stderr)
            continue
        except EOFError:
            if prompts:
                print(file=sys.stderr)  # end the prompt's line
            return 0
        if not line.strip():
            continue
        command, line = (None, line) if literal else _as_command(line)
        if command in QUIT_COMMANDS:
            return 0
        if command == "/reset":
            messages = messages[:1] if args.system else []
            continue
        if command in HELP_COMMANDS:
            print(CHAT_HELP, file=sys.stderr)
            continue
        if command is not None and command not in ("/continue", "/retry"):
            print(f"unknown command {command}, see /help (to send it as a message, write "
                  f"/{command})", file=sys.stderr)
            continue
        going_on = command == "/continue"
        if command is not None and not (messages and messages[-1]["role"] == "assistant"
                                        and messages[-1]["content"].strip()):
            print(f"nothing to {command[1:]}: no reply yet", file=sys.stderr)
            continue
        turn_options, replaced = options, None
        if command == "/retry":
            # the reply goes; the new one is drafted from it, with the next seed so that a
            # sampled reply differs (and --seed N with the same commands repeats the chat)
            replaced = messages.pop()
            retries += 1
            turn_options = replace(options, reference=replaced["content"], sampling=replace(
                options.sampling, seed=(options.sampling.seed + retries) % 2**64))
            sys.stdout.write("assistant (again)> ")
        elif going_on:
            from engine.events import without_cut_mark

            messages[-1] = {"role": "assistant",
                            "content": without_cut_mark(messages[-1]["content"])}
            sys.stdout.write("assistant (continued)> " + _tail(messages[-1]["content"]))
        else:
            messages.append({"role": "user", "content": line})
            sys.stdout.write("assistant> ")
        written: list = []
        try:
            finished, _ = _stream(session, messages, turn_options, sys.stdout,
                                  continue_final=going_on, steps=written)
        except EngineError as e:
            if replaced is not None:
                messages.append(replaced)  # the reply it would have replaced stays
            elif not going_on:
                messages.pop()
            sys.stdout.write("\n")  # the reply's line ends in stdout, which a script reads
            print(f"error: {e}", file=sys.stderr)
            continue
        except KeyboardInterrupt:
            # what was written stays, as Stop keeps it in the app: /continue goes on from it
            partial = "".join(step.text for step in written)
            if going_on:
                messages[-1] = {"role": "assistant",
                                "content": messages[-1]["content"] + partial}
            elif partial.strip():
                messages.append({"role": "assistant", "content": partial})
            elif replaced is not None:
                messages.append(replaced)
            else:
                messages.pop()
            sys.stdout.write("\n")
            print("[stopped: /continue goes on from here]" if partial.strip() else
                  "[stopped]", file=sys.stderr)
            continue
        s = finished.stats
        sys.stdout.write("\n")
        print(f"[{s.generated_tokens} tokens · {s.decode_tps:.1f} tok/s · "
              f"{s.tau:.2f} tokens/pass · {_prompt_read(s)}{_dropped(s)}]", file=sys.stderr)
        if going_on:
            messages[-1] = {"role": "assistant", "content": messages[-1]["content"] + finished.text}
        else:
            messages.append({"role": "assistant", "content": finished.text})


def cmd_import_gguf(args: argparse.Namespace) -> int:
    from engine.gguf import import_gguf

    dest = import_gguf(args.file, args.dest)
    print(f"imported {args.file} -> {dest}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from engine.bench import run_cli

    return run_cli(args)


def cmd_serve(args: argparse.Namespace) -> int:
    from app.server.run import serve

    return serve(args)


def cmd_train_drafter(args: argparse.Namespace) -> int:
    from app.cli.train import run

    return run(args)


def cmd_doctor(args: argparse.Namespace) -> int:
    from engine.doctor import run_doctor

    print("\n".join(run_doctor(recheck=args.recheck).lines()))
    return 0


def cmd_gui(model: str | None = None, *, smoke: bool = False) -> int:
    """The app, on `model` when given, else on the model last used (the settings keep it)."""
    from app.ui.gui import run_gui

    return run_gui(model, smoke=smoke)


COMMANDS = {
    "generate": cmd_generate,
    "chat": cmd_chat,
    "import-gguf": cmd_import_gguf,
    "bench": cmd_bench,
    "serve": cmd_serve,
    "train-drafter": cmd_train_drafter,
    "doctor": cmd_doctor,
}


def _show_app_warnings() -> None:
    """Print the app's own warnings (`engine.errors.AppWarning`: a cache it could not write,
    a damaged file it moved aside) as one `warning:` line; Python's default names the
    source line that warned, which means nothing to a user. Library warnings keep that
    form, which is what their authors need to see. Installed once per process."""
    import contextlib
    import warnings

    from engine.errors import AppWarning

    shown = warnings.showwarning
    if getattr(shown, "_understudy", False):
        return

    def show(message, category, filename, lineno, file=None, line=None):
        if not issubclass(category, AppWarning):
            return shown(message, category, filename, lineno, file, line)
        with contextlib.suppress(OSError):  # stderr closed: dropped, as Python's own does
            print(f"warning: {message}", file=file or sys.stderr)

    show._understudy = True  # type: ignore[attr-defined]
    warnings.showwarning = show


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    _show_app_warnings()
    # older macOS passes a process serial number to apps opened from the Finder
    argv = [a for a in argv if not a.startswith("-psn_")]
    ensure_openblas(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is not None and args.gui_model is not None:
        parser.error(f"--model before a command opens the app; for {args.command}, put it "
                     f"after: understudy {args.command} --model {args.gui_model}")
    from engine.errors import EngineError

    try:
        if args.command is None:
            return cmd_gui(args.gui_model, smoke=args.smoke)
        if args.command == "models":
            from app.cli import models as models_cli

            return models_cli.run(args)
        return COMMANDS[args.command](args)
    except EngineError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # stdout closed early (`| head`): stop quietly; point stdout at devnull so the
        # interpreter's final flush does not raise again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except OSError as e:  # unreadable/unwritable paths, a full disk: the user's to fix
        print(f"error: {e}", file=sys.stderr)
        return 1


def run() -> NoReturn:
    """The process entry (`understudy`, `python -m app.cli`, the packaged app): `main`, then
    an exit that no thread or library exit handler can hold up (`app.bounded_exit`).
    Tests call `main` in-process instead."""
    try:
        code = main()
    except SystemExit as e:  # argparse: --help, a bad argument
        code = exit_code(e)
    except KeyboardInterrupt:
        code = 130
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    exit_now(code)


if __name__ == "__main__":
    run()
