"""`understudy generate | chat | import-gguf`: output shapes, flags, errors, the launcher.

Most tests call `app.cli.main` in-process (fast); the ones about what a user sees from a
real process — one-line errors without a traceback, the interactive chat over stdin, the
OpenBLAS re-exec — run `python -m app.cli` in a subprocess.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from app.cli import main
from engine.tokenizer import Tokenizer
from tests.engine.test_decode import CHAIN_TEXT, write_chain_model
from tests.fixtures.tiny_models import write_tiny_model

REPO = Path(__file__).resolve().parents[2]
STATS_KEYS = {
    "prompt_tokens", "prefilled_tokens", "generated_tokens", "prompt_tps", "decode_tps",
    "target_passes", "tau", "acceptance", "drafted", "accepted", "draft_s", "verify_s",
    "prompt_s", "decode_s", "peak_memory_bytes", "finish_reason", "dropped_messages",
    "seed",  # the sampling seed, so a run at temperature > 0 can be repeated
}
PRIME = "Write a Python function that checks if a number is prime."


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("cli") / "tiny")


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Greedy reply to any prompt: CHAIN_TEXT, then eos."""
    return write_chain_model(tmp_path_factory.mktemp("cli") / "chain")


def gen_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main(["generate", *argv, "--json"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1  # exactly one JSON line
    return json.loads(out)


def cli(*argv: str, data_dir: Path, stdin: str | None = None,
        env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    run_env = {**os.environ, "UNDERSTUDY_DATA_DIR": str(data_dir), **(env or {})}
    return subprocess.run([sys.executable, "-m", "app.cli", *argv], cwd=REPO, env=run_env,
                          input=stdin, capture_output=True, text=True, timeout=timeout)


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "Traceback" not in proc.stderr
    for needle in needles:
        assert needle in lines[0]


# -------------------------------------------------------------------------- generate


def test_generate_streams_text(chain: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--model", str(chain), "--prompt", "Hi"]) == 0
    out, err = capsys.readouterr()
    assert out == CHAIN_TEXT + "\n"
    assert "12 tokens" in err and "eos" in err


def test_generate_speculates_by_default_with_plain_decodings_text(
        chain: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Without --drafter, generate drafts as the app and `serve` do (auto): a reply that
    copies its prompt is drafted by prompt lookup, and the text is plain decoding's."""
    prompt = ["--model", str(chain), "--prompt", f"Say this: {CHAIN_TEXT}"]
    default = gen_json(capsys, *prompt)
    plain = gen_json(capsys, *prompt, "--drafter", "none")
    assert default["text"] == plain["text"] == CHAIN_TEXT
    assert plain["stats"]["drafted"] == 0  # the control
    assert default["stats"]["accepted"] > 0
    assert default["stats"]["target_passes"] < plain["stats"]["target_passes"]


def test_generate_json_shape(chain: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # plain decoding: every token the target's (prompt lookup would guess from one-token
    # matches of the template's tokens; the test above covers drafting)
    result = gen_json(capsys, "--model", str(chain), "--prompt", "Hi", "--drafter", "none")
    assert set(result) == {"text", "tokens", "stats"}
    assert set(result["stats"]) == STATS_KEYS
    assert result["text"] == CHAIN_TEXT == "".join(t["text"] for t in result["tokens"])
    ids = Tokenizer.from_folder(chain).encode(CHAIN_TEXT)
    assert [t["id"] for t in result["tokens"]] == ids
    assert {t["kind"] for t in result["tokens"]} == {"target"}
    stats = result["stats"]
    assert stats["generated_tokens"] == len(ids) and stats["finish_reason"] == "eos"
    assert stats["prompt_tps"] > 0 and stats["decode_tps"] > 0 and stats["tau"] > 0
    assert stats["acceptance"] == 0 and stats["target_passes"] >= len(ids)


def test_generate_drafts_from_a_prediction_file(chain: Path, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """--prediction FILE: the reply is drafted from it (fewer passes than without), the
    text stays plain decoding's, and the stats say how much of it the reply wrote."""
    prediction = tmp_path / "predicted.txt"
    prediction.write_text(CHAIN_TEXT, encoding="utf-8")
    args = ["--model", str(chain), "--prompt", "Hi", "--drafter", "ngram"]
    with_it = gen_json(capsys, *args, "--prediction", str(prediction))
    without = gen_json(capsys, *args)
    assert with_it["text"] == without["text"] == CHAIN_TEXT
    n = len(Tokenizer.from_folder(chain).encode(CHAIN_TEXT))
    assert with_it["stats"]["prediction"] == {"accepted_tokens": n, "rejected_tokens": 0}
    assert "prediction" not in without["stats"]
    assert with_it["stats"]["target_passes"] * 2 < without["stats"]["target_passes"]
    # a prediction the reply does not follow: same text, every token of it rejected
    prediction.write_text("1234567", encoding="utf-8")
    wrong = gen_json(capsys, *args, "--prediction", str(prediction))
    assert wrong["text"] == CHAIN_TEXT and wrong["stats"]["prediction"]["accepted_tokens"] == 0
    assert main(["generate", *args, "--prediction", str(prediction)]) == 0
    assert "0 of " in capsys.readouterr().err


@pytest.mark.parametrize("name, content, needle", [
    ("missing.txt", None, "no such file"),
    ("latin1.txt", "caf\xe9".encode("latin-1"), "not UTF-8 text"),
    ("folder", "dir", "is a folder"),
])
def test_a_bad_prediction_file_is_one_line_naming_it(chain: Path, tmp_path: Path, name: str,
                                                     content, needle: str) -> None:
    path = tmp_path / name
    if content == "dir":
        path.mkdir()
    elif content is not None:
        path.write_bytes(content)
    proc = cli("generate", "--model", str(chain), "--prompt", "Hi", "--prediction", str(path),
               data_dir=tmp_path / "data")
    assert_one_line_error(proc, "--prediction", str(path), needle)


def test_messages_file_and_system(chain: Path, tmp_path: Path,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    tok = Tokenizer.from_folder(chain)
    convo = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi!"},
             {"role": "user", "content": "Tell me more about the fox."}]
    file = tmp_path / "messages.json"
    file.write_text(json.dumps(convo))

    result = gen_json(capsys, "--model", str(chain), "--messages", str(file))
    assert result["stats"]["prompt_tokens"] == len(tok.encode_chat(convo))
    assert result["text"] == CHAIN_TEXT

    system = {"role": "system", "content": "You are terse."}
    result = gen_json(capsys, "--model", str(chain), "--messages", str(file),
                      "--system", system["content"])
    assert result["stats"]["prompt_tokens"] == len(tok.encode_chat([system, *convo]))

    result = gen_json(capsys, "--model", str(chain), "--prompt", "Hello",
                      "--system", system["content"])
    assert result["stats"]["prompt_tokens"] == len(
        tok.encode_chat([system, {"role": "user", "content": "Hello"}]))


def test_the_message_as_an_argument_or_piped(chain: Path, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """`understudy generate "Hello"` and `echo Hello | understudy generate` send the same
    message as --prompt; an empty pipe is one line naming it."""
    want = len(Tokenizer.from_folder(chain).encode_chat([{"role": "user", "content": "Hello"}]))
    result = gen_json(capsys, "--model", str(chain), "Hello")
    assert result["stats"]["prompt_tokens"] == want and result["text"] == CHAIN_TEXT

    piped = cli("generate", "--model", str(chain), "--json", data_dir=tmp_path, stdin="Hello")
    assert piped.returncode == 0, piped.stderr
    assert json.loads(piped.stdout)["stats"]["prompt_tokens"] == want
    longer = cli("generate", "--model", str(chain), "--json", data_dir=tmp_path,
                 stdin="Hello, and a longer question than that")
    assert json.loads(longer.stdout)["stats"]["prompt_tokens"] > want  # the pipe is read

    assert_one_line_error(cli("generate", "--model", str(chain), data_dir=tmp_path,
                              stdin=" \n"), "standard input was empty", "--prompt")
    both = cli("generate", "--model", str(chain), "Hi", "--prompt", "Hi", data_dir=tmp_path)
    assert both.returncode == 2 and "not allowed with" in both.stderr


def test_a_model_without_chat_template_is_one_warning_line(tmp_path: Path) -> None:
    """Once, as the app's `warning:` line: not also Python's form naming a source line."""
    folder = write_tiny_model(tmp_path / "plain")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    proc = cli("generate", "--model", str(folder), "--prompt", "Hi", "--max-tokens", "2",
               data_dir=tmp_path / "data")
    assert proc.returncode == 0, proc.stderr
    warned = [line for line in proc.stderr.splitlines() if "chat template" in line]
    assert warned == [f"warning: {folder} has no chat template; using ChatML, which this "
                      "model may not have been trained on, so replies may be poor"], proc.stderr
    assert "Warning" not in proc.stderr


@pytest.mark.parametrize(
    ("content", "needle"),
    [("not json", "not valid JSON"), ('{"role": "user"}', "list of {role, content}"),
     ('[{"role": "user", "content": 3}]', "list of {role, content}")],
)
def test_bad_messages_file(chain: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                           content: str, needle: str) -> None:
    file = tmp_path / "m.json"
    file.write_text(content)
    assert main(["generate", "--model", str(chain), "--messages", str(file)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: {file}") and needle in err and err.count("\n") == 1


def test_sampling_flags_reach_the_sampler(tiny: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def ids(*flags: str) -> list[int]:
        out = gen_json(capsys, "--model", str(tiny), "--prompt", "Hello world", "--max-tokens",
                       "10", *flags)
        assert out["stats"]["generated_tokens"] == len(out["tokens"])
        return [t["id"] for t in out["tokens"]]

    greedy = ids()
    assert len(greedy) == 10  # --max-tokens
    hot = ["--temperature", "1"]
    assert ids(*hot, "--seed", "1") == ids(*hot, "--seed", "1")
    assert len({tuple(ids(*hot, "--seed", str(s))) for s in (1, 2, 3)}) > 1
    # each filter alone cut down to the single most likely token gives back greedy text
    assert ids(*hot, "--seed", "1", "--top-k", "1") == greedy
    assert ids(*hot, "--seed", "1", "--top-p", "0.0001") == greedy
    assert ids(*hot, "--seed", "1", "--min-p", "1") == greedy
    assert ids("--max-tokens", "3") == greedy[:3]


def test_without_seed_each_sampled_run_draws_one_and_reports_it(
        tiny: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Before, --seed defaulted to 0, so every run at temperature > 0 wrote the same text.
    Now a run without --seed draws a seed, reports it in the stats, and --seed with that
    value repeats the run; greedy decoding (temperature 0) is unchanged and reports 0."""
    argv = ["--model", str(tiny), "--prompt", "Hello world", "--max-tokens", "12"]
    hot = [*argv, "--temperature", "1"]
    runs = [gen_json(capsys, *hot) for _ in range(4)]
    seeds = [run["stats"]["seed"] for run in runs]
    assert len(set(seeds)) == 4 and all(isinstance(seed, int) for seed in seeds)
    assert len({run["text"] for run in runs}) > 1
    again = gen_json(capsys, *hot, "--seed", str(seeds[0]))
    assert again["text"] == runs[0]["text"] and again["stats"]["seed"] == seeds[0]
    greedy = [gen_json(capsys, *argv) for _ in range(2)]
    assert greedy[0]["text"] == greedy[1]["text"]
    assert greedy[0]["stats"]["seed"] == greedy[1]["stats"]["seed"] == 0
    # the stats line says the seed too, where there is one
    assert main(["generate", *hot, "--seed", "77"]) == 0
    # (a run that drafted nothing adds a line saying why after it)
    stats = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[")]
    assert len(stats) == 1 and stats[0].endswith(" · seed 77]")
    assert main(["generate", *argv]) == 0
    assert "seed" not in capsys.readouterr().err


def test_stop_flag(chain: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = gen_json(capsys, "--model", str(chain), "--prompt", "Hi", "--stop", "fox")
    assert result["text"] == "Hé🦊 " and result["stats"]["finish_reason"] == "stop"


@pytest.mark.parametrize(
    ("flags", "needle"),
    [(["--max-tokens", "0"], "max_tokens"), (["--temperature", "-1"], "temperature"),
     (["--top-p", "0"], "top_p"), (["--k", "many"], "--k"), ([], "--prompt")],
)
def test_bad_flags_are_one_line_errors(chain: Path, capsys: pytest.CaptureFixture[str],
                                       monkeypatch: pytest.MonkeyPatch,
                                       flags: list[str], needle: str) -> None:
    prompt = ["--prompt", "Hi"] if flags else []
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))  # nothing piped either
    assert main(["generate", "--model", str(chain), *prompt, *flags]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and needle in err and err.count("\n") == 1


def test_messages_and_flags_the_server_refuses_are_refused(
        chain: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The CLI takes what the server takes: the same four roles ("developer" being a
    system message) and no empty stop string; and --system does not silently give way
    to a messages file's own system message."""
    def run(*flags: str) -> str:
        assert main(["generate", "--model", str(chain), *flags]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1, err
        return err

    wizard = tmp_path / "wizard.json"
    wizard.write_text(json.dumps([{"role": "wizard", "content": "hi"}]))
    assert run("--messages", str(wizard)) == (
        f"error: {wizard}[0]: role 'wizard' is not one of system, developer, user, assistant\n")
    assert run("--prompt", "Hi", "--stop", "") == "error: stop: stop strings must not be empty\n"
    system = tmp_path / "system.json"
    system.write_text(json.dumps([{"role": "developer", "content": "Be terse."},
                                  {"role": "user", "content": "Hi"}]))
    assert run("--messages", str(system), "--system", "Be kind.") == (
        f"error: --system: {system} already starts with a system message; give the system "
        "prompt in one place\n")
    # a developer message is a system message, as the server reads it
    tok = Tokenizer.from_folder(chain)
    result = gen_json(capsys, "--model", str(chain), "--messages", str(system))
    assert result["stats"]["prompt_tokens"] == len(tok.encode_chat(
        [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}]))


def test_piped_text_beside_another_message_is_named(chain: Path, tmp_path: Path) -> None:
    """`echo text | understudy generate --messages chat.json`: the piped text is not
    used, and a warning says so (before: silently dropped). The pipe is filled and
    closed before the process starts, so the test does not depend on timing."""
    messages = tmp_path / "chat.json"
    messages.write_text(json.dumps([{"role": "user", "content": "Hi"}]))

    def run(stdin: int | None, *flags: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "app.cli", "generate", "--model", str(chain), *flags],
            cwd=REPO, env={**os.environ, "UNDERSTUDY_DATA_DIR": str(tmp_path)},
            stdin=stdin, capture_output=True, text=True, timeout=120)

    def piped(*flags: str) -> subprocess.CompletedProcess:
        read, write = os.pipe()
        os.write(write, b"text nobody reads\n")
        os.close(write)
        try:
            return run(read, *flags)
        finally:
            os.close(read)

    for flags, source in [(("--messages", str(messages)), "--messages"),
                          (("--prompt", "Hi"), "--prompt"), (("Hi",), "the argument")]:
        proc = piped(*flags)
        assert proc.returncode == 0 and proc.stdout == CHAIN_TEXT + "\n", proc.stderr
        warnings = [ln for ln in proc.stderr.splitlines() if ln.startswith("warning:")]
        assert warnings == [
            f"warning: standard input is not read: the message comes from {source}"]
    with (tmp_path / "piped.txt").open("w+") as file:  # `< file` is standard input too
        file.write("text\n")
        file.seek(0)
        assert "standard input is not read" in run(file.fileno(), "--prompt", "Hi").stderr
    # nothing waiting (/dev/null, a closed empty pipe): no warning
    quiet = run(subprocess.DEVNULL, "--prompt", "Hi")
    assert quiet.returncode == 0 and "warning" not in quiet.stderr
    read, write = os.pipe()
    os.close(write)
    try:
        assert "warning" not in run(read, "--messages", str(messages)).stderr
    finally:
        os.close(read)
    # and the pipe alone is still the message
    proc = piped()
    assert proc.returncode == 0 and "warning" not in proc.stderr


def test_help_shows_every_options_default(capsys: pytest.CaptureFixture[str]) -> None:
    """Before, `generate --help` said nothing about --max-tokens, --temperature, --top-p
    or --seed, `serve --help` not --port's 1234, and `import-gguf --help` did not say
    what its two arguments are."""
    def help_of(*command: str) -> str:
        with pytest.raises(SystemExit) as e:
            main([*command, "--help"])
        assert e.value.code == 0
        return " ".join(capsys.readouterr().out.split())  # unwrapped

    generate = help_of("generate")
    for line in ["--max-tokens MAX_TOKENS most tokens to write in one reply (default: 512)",
                 "--temperature TEMPERATURE sampling temperature; 0 picks the most likely "
                 "token (greedy) (default: 0.0)",
                 "(nucleus sampling); 1 = no limit (default: 1.0)",
                 "--top-k TOP_K sample from the K most likely tokens only; 0 = no limit "
                 "(default: 0)",
                 "--min-p MIN_P drop tokens less likely than P times the most likely one; "
                 "0 = off (default: 0.0)",
                 "(default: 1.0)", "--k K draft length",
                 "--seed SEED random seed for sampling at temperature > 0 (default: a new "
                 "random seed each run, reported in the stats so --seed N repeats the run)"]:
        assert line in generate
    assert "--port PORT port to listen on, 0-65535 (default 1234; 0 picks a free one)" \
        in help_of("serve")
    assert "--queue QUEUE requests that may wait behind the running one (more get 429) " \
           "(default: 16)" in help_of("serve")
    gguf = help_of("import-gguf")
    assert "file the .gguf file to convert" in gguf and "dest the model folder to write" in gguf
    bench = help_of("bench")
    assert "--seed SEED random seed for sampling at temperature > 0, the same for every " \
           "mode (default: 0)" in bench
    assert "--max-tokens MAX_TOKENS most tokens to write per reply (default: 128)" in bench
    assert "--seed SEED seed for the head's initial weights and the order of the data " \
           "(default: 0)" in help_of("train-drafter")
    assert "--limit LIMIT most results to show (default 20)" in help_of("models", "search")
    # no "(default: None)" or "(default: False)" noise
    for text in (generate, bench, help_of("chat"), help_of("serve")):
        assert "(default: None)" not in text and "(default: False)" not in text


def test_chat_refuses_unknown_commands(chain: Path, tmp_path: Path) -> None:
    """A lone /word that is no command (a typo of /exit, say) is refused with a hint
    instead of being sent to the model; //word sends "/word", and a line that merely
    starts with a slash ("/usr/bin is…", a path) is a message as before."""
    proc = cli("chat", "--model", str(chain), "--max-tokens", "2", data_dir=tmp_path,
               stdin="/bogus\n/exti\n//bogus\n/usr/bin is where\n/usr/bin/env\n"
                     '"""\n/bogus\n"""\n/bye\n')
    assert proc.returncode == 0, proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("unknown command")]
    assert errors == ["unknown command /bogus, see /help (to send it as a message, write "
                      "//bogus)",
                      "unknown command /exti, see /help (to send it as a message, write "
                      "//exti)"]
    assert proc.stdout.count("assistant> ") == 4  # //bogus, the two lines, the block
    stats = [ln for ln in proc.stderr.splitlines() if ln.startswith("[")]
    assert len(stats) == 4


def test_chat_reports_the_seed_it_samples_with(chain: Path, tmp_path: Path) -> None:
    proc = cli("chat", "--model", str(chain), "--temperature", "0.5", "--seed", "31",
               "--max-tokens", "2", data_dir=tmp_path, stdin="/bye\n")
    assert "sampling at temperature 0.5 with seed 31 (--seed 31 repeats this chat)" \
        in proc.stderr.splitlines()
    drawn = cli("chat", "--model", str(chain), "--temperature", "0.5", data_dir=tmp_path,
                stdin="/bye\n")
    assert re.search(r"^sampling at temperature 0\.5 with seed (\d+) \(--seed \1 repeats",
                     drawn.stderr, re.MULTILINE)
    greedy = cli("chat", "--model", str(chain), data_dir=tmp_path, stdin="/bye\n")
    assert "seed" not in greedy.stderr


def test_import_gguf_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["import-gguf", str(tmp_path / "nope.gguf"), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "nope.gguf" in err and err.count("\n") == 1


def test_unwritable_import_destination(demo_gguf_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["import-gguf", str(demo_gguf_path), "/proc/no/such/dir"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "/proc/no" in err and err.count("\n") == 1


# ------------------------------------------------------------------ real processes


def test_nonexistent_model_is_one_line(tmp_path: Path) -> None:
    proc = cli("generate", "--model", "/nonexistent", "--prompt", "Hi", data_dir=tmp_path)
    assert_one_line_error(proc, "/nonexistent")
    assert proc.stdout == ""


def test_corrupt_config_is_one_line(tiny: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in tiny.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    (broken / "config.json").write_text('{"model_type": "llama", "hidden_size": ')
    proc = cli("generate", "--model", str(broken), "--prompt", "Hi", data_dir=tmp_path)
    assert_one_line_error(proc, "config.json", "invalid JSON")


def test_config_that_does_not_match_the_weights_is_one_line(tmp_path: Path) -> None:
    """A hidden_size that does not match 4-bit weights: before, MLX's quantize refused the
    group size it implied, with a traceback."""
    folder = write_tiny_model(tmp_path / "q4", quantize=(32, 4))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "hidden_size": 56}))
    proc = cli("generate", "--model", str(folder), "--prompt", "Hi", data_dir=tmp_path)
    assert_one_line_error(proc, f"{folder}/config.json: hidden_size is 56 but the weights "
                          "have 64")
    proc = cli("models", "import", str(folder), data_dir=tmp_path)
    assert_one_line_error(proc, "hidden_size is 56")
    assert proc.stdout == "" and not (tmp_path / "models" / "q4").exists()


def test_closed_stdout_is_not_a_traceback(tiny: Path, tmp_path: Path) -> None:
    """`understudy generate ... | head`: the reader goes away; exit quietly (141, as a shell
    reports SIGPIPE) instead of printing a BrokenPipeError traceback."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "generate", "--model", str(tiny), "--prompt", "Hi"],
        cwd=REPO, env={**os.environ, "UNDERSTUDY_DATA_DIR": str(tmp_path)},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    proc.stdout.close()  # before the first token is written
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 141 and err == b"", err


def test_chat_keeps_the_conversation(tiny: Path, tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    """Two turns over stdin, the second pasted between triple-quote lines with a blank
    line inside (one message, not three), then /bye quits (EOF quits too: see the launcher
    test); an empty line is ignored. Each answer is the one `generate` gives for the
    whole conversation."""
    turns = ["Hello there", "And\n\nagain?"]
    proc = cli("chat", "--model", str(tiny), "--max-tokens", "6", data_dir=tmp_path,
               stdin="\n".join(["Hello there", "", '"""', "And", "", "again?", '"""',
                                "/bye", "never read", ""]))
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    stats = [ln for ln in proc.stderr.splitlines() if ln.startswith("[6 tokens")]
    assert len(stats) == 2
    # the second turn read only its new tokens: the first turn's were still cached
    assert " · prompt " in stats[0] and "cached" not in stats[0]
    assert re.search(r" · prompt \d+\.\d\d s \([\d,]+ of [\d,]+ tokens cached\)\]$", stats[1])
    # piped input: no prompts in stdout, each reply on a line of its own; /bye: "never
    # read" was never read
    answers = [part.removesuffix("\n") for part in proc.stdout.split("assistant> ")[1:]]
    assert proc.stdout == "".join(f"assistant> {a}\n" for a in answers)
    assert len(answers) == 2

    convo: list[dict[str, str]] = []
    for turn, answer in zip(turns, answers, strict=True):
        convo.append({"role": "user", "content": turn})
        file = tmp_path / f"convo{len(convo)}.json"
        file.write_text(json.dumps(convo))
        expected = gen_json(capsys, "--model", str(tiny), "--messages", str(file),
                            "--max-tokens", "6")["text"]
        assert answer == expected
        convo.append({"role": "assistant", "content": answer})


def test_piped_chat_prints_only_the_replies(chain: Path, tmp_path: Path) -> None:
    """`printf 'Hello\\nline two\\n' | understudy chat`: no "you> " or "... " prompts in
    stdout (as Python's REPL and sqlite3 with piped input), one reply a line; a line is
    a message, a triple-quoted block one message, /help still answers (on stderr), and
    the end of input quits cleanly, closing a block left open so its text is still sent."""
    reply = f"assistant> {CHAIN_TEXT}\n"
    proc = cli("chat", "--model", str(chain), data_dir=tmp_path,
               stdin='Hello\nline two\n/help\n"""\nfirst\n\nsecond\n"""\n"""\nleft open\n')
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == reply * 4
    assert "Traceback" not in proc.stderr and "you> " not in proc.stderr
    assert "/continue           write on from the end of the last reply" in proc.stderr
    assert len([ln for ln in proc.stderr.splitlines() if ln.startswith("[")]) == 4
    # an empty block at the end is nothing to send
    empty = cli("chat", "--model", str(chain), data_dir=tmp_path, stdin='Hi\n"""\n')
    assert (empty.returncode, empty.stdout) == (0, reply)


@pytest.mark.parametrize("locale", ["C.UTF-8", "en_US.UTF-8"])
def test_chat_and_generate_take_input_that_is_not_utf8(chain: Path, tmp_path: Path,
                                                         locale: str) -> None:
    """A Latin-1 "café" piped in: its stray byte reads as U+FFFD and the model answers,
    where before a traceback came (UnicodeDecodeError under a strict UTF-8 locale; the C
    locale's surrogate escape crashed the tokenizer)."""
    env = {**os.environ, "UNDERSTUDY_DATA_DIR": str(tmp_path), "LC_ALL": locale,
           "PYTHONIOENCODING": "" if locale == "C.UTF-8" else "utf-8:strict"}
    for argv, expected in ((["chat"], f"assistant> {CHAIN_TEXT}\n".encode()),
                           (["generate"], f"{CHAIN_TEXT}\n".encode())):
        proc = subprocess.run([sys.executable, "-m", "app.cli", *argv, "--model", str(chain)],
                              cwd=REPO, env=env, input=b"caf\xe9\n", capture_output=True,
                              timeout=120)
        assert b"Traceback" not in proc.stderr, proc.stderr.decode(errors="replace")
        assert (proc.returncode, proc.stdout) == (0, expected)


@pytest.mark.skipif(sys.platform == "win32", reason="pseudo-terminals are POSIX")
def test_chat_on_a_terminal_still_prompts(chain: Path, tmp_path: Path) -> None:
    """Typed at a terminal, chat asks with "you> " and "... " (Python writes input()'s
    prompt to stdout when stdout is not a terminal, so the pipe here sees it)."""
    import pty

    leader, follower = pty.openpty()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "app.cli", "chat", "--model", str(chain)], cwd=REPO,
            env={**os.environ, "UNDERSTUDY_DATA_DIR": str(tmp_path)}, stdin=follower,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        os.write(leader, b'"""\nHi\n"""\n/bye\n')
        out, err = proc.communicate(timeout=120)
    finally:
        os.close(leader)
        os.close(follower)
    assert proc.returncode == 0, err
    assert out == f"you> ... ... assistant> {CHAIN_TEXT}\nyou> "


@pytest.mark.skipif(sys.platform == "win32", reason="pseudo-terminals are POSIX")
def test_chat_at_a_terminal_edits_lines_and_takes_long_ones(chain: Path, tmp_path: Path) -> None:
    """At a terminal the line is read with line editing: a pasted 5,000-character line
    arrives whole (the kernel's own line reading cut it at 4,095 without a word) and the
    arrow keys move the cursor ("/ye", Left, Left, "b" is /bye) instead of landing in the
    message as escape codes."""
    import pty
    import select

    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "chat", "--model", str(chain)], cwd=REPO,
        env={**os.environ, "UNDERSTUDY_DATA_DIR": str(tmp_path), "TERM": "xterm"},
        stdin=follower, stdout=follower, stderr=subprocess.PIPE, text=True)
    os.close(follower)
    shown, sent = b"", False
    deadline = time.monotonic() + 60
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            if select.select([leader], [], [], 0.1)[0]:
                try:
                    shown += os.read(leader, 65536)
                except OSError:  # the chat closed the terminal: it has quit
                    break
            if not sent and b"you> " in shown:  # readline holds the terminal from here
                # then Ctrl-D, which ends a chat that took "/ye^[[D^[[Db" as a typo
                os.write(leader, b"/" + b"x" * 5000 + b"\n/ye\x1b[D\x1b[Db\n\x04")
                sent = True
        _, err = proc.communicate(timeout=10)
    finally:
        os.close(leader)
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    refused = [ln for ln in err.splitlines() if ln.startswith("unknown command")]
    assert refused == [f"unknown command /{'x' * 5000}, see /help (to send it as a message, "
                       f"write //{'x' * 5000})"]


def test_chat_continue_finishes_a_reply_cut_at_max_tokens(chain: Path, tmp_path: Path) -> None:
    """The chain model's reply cut at 4 tokens; /continue writes the rest, so the two parts
    make the whole reply (the echo of where it goes on from, then the new text). /continue
    with no reply yet says so and asks again."""
    proc = cli("chat", "--model", str(chain), "--max-tokens", "4", data_dir=tmp_path,
               stdin="/continue\nHi\n" + "/continue\n" * 3 + "/bye\n")
    assert proc.returncode == 0, proc.stderr
    assert "nothing to continue" in proc.stderr
    first = proc.stdout.split("assistant> ")[1].partition("\n")[0]
    # each continuation echoes the reply so far (all of it: under 60 characters), then
    # writes on; 4 tokens cut 🦊 (4 byte tokens) in two, so its cut mark went
    parts = [p.partition("\n")[0]
             for p in proc.stdout.split("assistant (continued)> ")[1:]]
    assert first == "Hé\ufffd" and parts[:2] == ["Hé🦊", "Hé🦊 fox"]
    assert parts[2] == CHAIN_TEXT  # "!", then eos
    stats = [ln.split(" · ")[0] for ln in proc.stderr.splitlines() if ln.startswith("[")]
    assert stats == ["[4 tokens", "[4 tokens", "[4 tokens", "[1 tokens"]


def test_chat_retry_writes_the_last_reply_again_drafted_from_it(chain: Path,
                                                               tmp_path: Path) -> None:
    """/retry replaces the last reply: the chain model writes the same text again, now in
    far fewer passes (drafted from the old reply); with no reply yet it says so. The
    conversation keeps one reply: the next message's prompt holds the new one only."""
    proc = cli("chat", "--model", str(chain), "--drafter", "ngram", data_dir=tmp_path,
               stdin="/retry\nHi\n/retry\nMore\n/bye\n")
    assert proc.returncode == 0, proc.stderr
    assert "nothing to retry: no reply yet" in proc.stderr
    first = proc.stdout.split("assistant> ")[1].partition("\n")[0]
    again = proc.stdout.split("assistant (again)> ")[1].partition("\n")[0]
    assert first == again == CHAIN_TEXT
    taus = [float(ln.split(" · ")[2].split()[0]) for ln in proc.stderr.splitlines()
            if ln.startswith("[")]
    assert len(taus) == 3 and taus[1] >= 3 * taus[0], taus  # the control: the first ~1
    without = cli("chat", "--model", str(chain), "--drafter", "ngram", data_dir=tmp_path,
                  stdin="Hi\nMore\n/bye\n")

    def last_prompt(stderr: str) -> str:
        return [ln for ln in stderr.splitlines() if ln.startswith("[")][-1].split("of ")[1]

    assert last_prompt(proc.stderr) == last_prompt(without.stderr)  # "N tokens cached)"


class CtrlCAt:
    """A real ChatSession whose next reply is interrupted after `steps` steps, as Ctrl-C
    does (a KeyboardInterrupt out of the stream): a signal sent from a test lands at a
    point that depends on the machine's speed, this lands at the same step every run."""

    def __init__(self, session, steps: int) -> None:
        self.session, self.steps = session, steps

    def generate(self, *args, **kwargs):
        events = self.session.generate(*args, **kwargs)
        steps, self.steps = self.steps, 0
        if not steps:
            return events

        def interrupted():
            from engine.events import Step

            seen = 0
            try:
                for event in events:
                    yield event
                    seen += isinstance(event, Step)
                    if seen == steps:
                        raise KeyboardInterrupt
            finally:
                events.close()

        return interrupted()


def test_chat_ctrl_c_keeps_what_was_written_for_continue(
        chain: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C mid-reply keeps the text written so far, as Stop does in the app, so
    /continue goes on from it: the chain model's reply stopped after 3 steps, then
    continued, is its whole reply."""
    from app.cli.main import _chat_loop, _options, _session, build_parser

    args = build_parser().parse_args(["chat", "--model", str(chain)])
    monkeypatch.setattr("sys.stdin", io.StringIO("Hi\n/continue\n/bye\n"))
    assert _chat_loop(args, CtrlCAt(_session(args), 3), _options(args)) == 0
    out, err = capsys.readouterr()
    assert "[stopped: /continue goes on from here]" in err and "Traceback" not in err
    # H, then é's two byte tokens; the stopped reply's line ends in stdout too, so a
    # script reading it sees one reply a line
    assert out == f"assistant> Hé\nassistant (continued)> {CHAIN_TEXT}\n"
    # (before, Ctrl-C dropped the turn, and /continue said "nothing to continue")


class TypedAtTerminal(io.StringIO):
    """Lines as typed at a terminal (so chat prompts), where a line "^C" is Ctrl-C pressed
    at the prompt: a real SIGINT lands wherever the process happens to be, this lands in
    the read every run."""

    def isatty(self) -> bool:
        return True

    def readline(self, size: int | None = -1) -> str:
        line = super().readline(size)
        if line == "^C\n":
            raise KeyboardInterrupt
        return line


def test_chat_ctrl_c_at_the_prompt_drops_the_line_not_the_chat(
        chain: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C at the prompt drops what was being typed (a half-typed triple-quoted block
    too) and asks again, as a shell or Python's REPL does; before, it quit the chat, so a
    Ctrl-C meant for a reply that had just ended lost the conversation. Ctrl-D quits."""
    monkeypatch.setenv("UNDERSTUDY_DATA_DIR", str(tmp_path))
    monkeypatch.setattr("sys.stdin", TypedAtTerminal('Hi\n^C\n"""\nhalf a block\n^C\nAgain\n'))
    assert main(["chat", "--model", str(chain)]) == 0
    out, err = capsys.readouterr()
    reply = f"assistant> {CHAIN_TEXT}\n"
    assert out == f"you> {reply}you> you> ... ... you> {reply}you> "
    assert len([ln for ln in err.splitlines() if ln.startswith("[")]) == 2


def test_chat_goes_on_past_the_context_window(tiny: Path, tmp_path: Path) -> None:
    """The model's window cut to 512 tokens: twelve turns of ~160 tokens each all get a
    reply, the later ones saying how many early messages they left out."""
    small = tmp_path / "small-window"
    shutil.copytree(tiny, small)
    config = json.loads((small / "config.json").read_text())
    config["max_position_embeddings"] = 512
    (small / "config.json").write_text(json.dumps(config))
    turns = [f"turn {i}: " + "a" * 150 for i in range(12)]
    proc = cli("chat", "--model", str(small), "--max-tokens", "8", data_dir=tmp_path,
               stdin="\n".join(turns) + "\n")
    assert proc.returncode == 0, proc.stderr
    assert "error" not in proc.stderr and "Traceback" not in proc.stderr
    stats = [ln for ln in proc.stderr.splitlines() if ln.startswith("[")]
    assert len(stats) == 12, proc.stderr
    assert "left out" not in stats[0]
    assert "earliest messages left out to fit the context window" in stats[-1]


def _maps_once_mlx_is_loaded(proc: subprocess.Popen, deadline: float) -> str:
    """/proc/<pid>/maps as soon as libmlx is mapped (so any re-exec has happened);
    "" if that never happens."""
    maps = Path(f"/proc/{proc.pid}/maps")
    while time.monotonic() < deadline and proc.poll() is None:
        text = maps.read_text()
        if "libmlx" in text:
            return text
        time.sleep(0.05)
    return ""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="OpenBLAS re-exec is Linux-only")
@pytest.mark.parametrize("no_reexec", [False, True])
def test_launcher_preloads_openblas(chain: Path, tmp_path: Path, no_reexec: bool) -> None:
    """Started without LD_PRELOAD, the CLI re-execs itself once with OpenBLAS preloaded
    (same pid); UNDERSTUDY_NO_REEXEC=1 turns that off (the negative control)."""
    from app.cli.launcher import openblas_path

    if openblas_path() is None:
        pytest.skip("system OpenBLAS (libopenblas0-pthread) is not installed")
    env = {k: v for k, v in os.environ.items()
           if k not in ("LD_PRELOAD", "UNDERSTUDY_NO_REEXEC", "OPENBLAS_CORETYPE")}
    env["UNDERSTUDY_DATA_DIR"] = str(tmp_path)
    # the kernels OpenBLAS would fall back to here, asked in a process of its own
    wanted = subprocess.run([sys.executable, "-m", "engine.blas_core", str(openblas_path())],
                            cwd=REPO, env=env, capture_output=True, text=True,
                            check=True).stdout.split()
    if no_reexec:
        env["UNDERSTUDY_NO_REEXEC"] = "1"
    proc = subprocess.Popen([sys.executable, "-m", "app.cli", "chat", "--model", str(chain)],
                            cwd=REPO, env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        maps = _maps_once_mlx_is_loaded(proc, time.monotonic() + 60)
        environ = Path(f"/proc/{proc.pid}/environ").read_bytes().split(b"\0")
    finally:
        _, err = proc.communicate(b"", timeout=60)  # EOF at the prompt: chat exits
    assert proc.returncode == 0, err
    assert "libmlx" in maps, f"the CLI never loaded MLX: {err!r}"
    assert ("libopenblas" in maps) is not no_reexec
    preload = [e for e in environ if e.startswith(b"LD_PRELOAD=")]
    if no_reexec:
        assert preload == []
    else:  # the environment of the re-executed image, set by the launcher
        assert len(preload) == 1 and b"libopenblas" in preload[0]
        assert b"UNDERSTUDY_NO_REEXEC=1" in environ
    core = sorted(e.decode() for e in environ if e.startswith(b"OPENBLAS_CORETYPE="))
    assert core == ([] if no_reexec else wanted)
    # ahead of OpenBLAS, our few-row product, built into this data dir's cache
    from engine.few_rows import compiler, unsupported

    ours = unsupported() is None and compiler() is not None
    assert ("libunderstudyblas" in maps) is (ours and not no_reexec)
    if ours and not no_reexec:
        assert preload[0].split(b"=", 1)[1].split(b":")[0].startswith(
            str(tmp_path / "cache" / "native").encode())


@pytest.mark.slow
def test_import_gguf_then_generate(demo_gguf_path: Path, tmp_path: Path) -> None:
    dest = tmp_path / "smollm2"
    proc = cli("import-gguf", str(demo_gguf_path), str(dest), data_dir=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert f"-> {dest}" in proc.stdout and (dest / "config.json").is_file()
    proc = cli("generate", "--model", str(dest), "--prompt", PRIME, "--max-tokens", "12",
               "--json", data_dir=tmp_path)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["text"].startswith("```python\ndef is_prime(")
    assert result["stats"]["generated_tokens"] == 12


def test_bench_names_the_categories_when_none_match(tiny: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--model", str(tiny), "--category", "nosuch"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no prompts left" in err
    assert "categories: chat, code-editing, code-generation" in err


@pytest.mark.parametrize("limit", ["0", "-1"])
def test_bench_limit_below_one_is_refused(tiny: Path, capsys: pytest.CaptureFixture[str],
                                          limit: str) -> None:
    """Before: --limit 0 ran every prompt and --limit -1 all but the last."""
    assert main(["bench", "--model", str(tiny), "--limit", limit, "--max-tokens", "2"]) == 1
    out, err = capsys.readouterr()
    assert err == f"error: --limit must be at least 1, got {limit}\n" and out == ""


def test_bench_report_path_is_checked_before_the_run(tiny: Path, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """A folder (or a missing folder) as --json is refused at once: before, the whole run
    went by and its results were lost when the report could not be written."""
    args = ["bench", "--model", str(tiny), "--limit", "1", "--max-tokens", "2"]
    assert main([*args, "--json", str(tmp_path)]) == 1
    out, err = capsys.readouterr()
    assert err == f"error: --json {tmp_path}: is a folder; give a file name for the report\n"
    assert out == ""  # no table: nothing ran
    missing = tmp_path / "no" / "report.json"
    assert main([*args, "--json", str(missing)]) == 1
    out, err = capsys.readouterr()
    assert err == f"error: --json {missing}: folder {missing.parent} does not exist\n"
    assert out == ""
    report = tmp_path / "report.json"
    assert main([*args, "--json", str(report)]) == 0
    assert json.loads(report.read_text())["overall"]["plain_tps"] > 0


def test_bench_keeps_a_fixed_seed_shared_by_its_modes(tiny: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Unlike generate's, bench's default seed stays 0: plain and spec sample with the
    same seed (the coupled rule then writes the same text), and two runs agree."""
    from app.cli.main import build_parser

    assert build_parser().parse_args(["bench"]).seed == 0
    assert build_parser().parse_args(["generate"]).seed is None
    counts = []
    for run in range(2):
        report = tmp_path / f"report{run}.json"
        assert main(["bench", "--model", str(tiny), "--temperature", "1", "--limit", "2",
                     "--max-tokens", "8", "--json", str(report)]) == 0
        rows = json.loads(report.read_text())["prompts"]
        assert [row["identical"] for row in rows] == [True, True]  # one seed for both modes
        counts.append([(row["plain_tokens"], row["spec_tokens"]) for row in rows])
    assert counts[0] == counts[1]
    capsys.readouterr()


def test_continue_marks_the_echo_of_a_long_reply_as_an_excerpt() -> None:
    """/continue echoes the last 60 characters of the reply it goes on from: cut mid-word
    and unmarked, it read as the reply printed again."""
    from app.cli.main import _tail

    assert _tail("short reply") == "short reply"
    long = "word " * 30
    assert _tail(long) == "\N{HORIZONTAL ELLIPSIS}" + long[-60:]


def test_a_reply_that_drafted_nothing_says_why(chain: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """`--drafter model` reading "1.00 tokens/pass · 0% accepted" looked broken: the
    stats line is followed by the reason; a reply that drafted, or asked for no drafter,
    gets no such line."""
    from app.cli.main import _nothing_drafted
    from engine.decode import GenerateOptions
    from engine.events import Stats

    idle = Stats(generated_tokens=12, target_passes=12)
    assert "judged slower than plain" in _nothing_drafted(GenerateOptions(drafter="model"), idle)
    assert "--k N" in _nothing_drafted(GenerateOptions(drafter="head"), idle)
    assert "prompt lookup found no earlier text" in _nothing_drafted(
        GenerateOptions(drafter="ngram"), idle)
    busy = Stats(generated_tokens=12, target_passes=4, n_drafted=10, n_accepted=8)
    assert _nothing_drafted(GenerateOptions(drafter="model"), busy) == ""
    assert _nothing_drafted(GenerateOptions(drafter="none"), idle) == ""
    # through the command: a copied prompt is drafted, so no note follows its stats
    assert main(["generate", "--model", str(chain), "--prompt", f"Say this: {CHAIN_TEXT}",
                 "--drafter", "ngram"]) == 0
    assert "nothing drafted" not in capsys.readouterr().err
