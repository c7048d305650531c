"""The online training buffer: what a chat records when the user opts in, and nothing else.

The key property: the buffer holds exactly the committed positions of each reply, with
the features and target distributions a teacher-forced pass over the same tokens computes
(rejected drafts never enter, whatever the drafter and tree did). Then: nothing when off,
bounded (oldest dropped), a damaged segment set aside with one line while the chat goes on,
and `--data history` training from the buffer instead of re-reading those replies.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from engine.cache import make_caches
from engine.decode import ChatSession, GenerateOptions
from engine.drafters.head_io import current_checkpoint, read_record
from engine.errors import EngineError
from engine.events import Finished
from engine.loading import LoadedModel, load_model
from engine.sampling import SamplingParams
from engine.training.data import TOP_K, Sample, topk_probs
from engine.training.fit import FitOptions
from engine.training.job import TrainOptions, train_drafter
from engine.training.online import OnlineBuffer, OnlineTap, online_dir, reply_id
from tests.fixtures.tiny_models import write_tiny_model

PROMPT = [{"role": "user", "content": "Hello world! The quick brown fox"}]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[LoadedModel, LoadedModel]:
    root = tmp_path_factory.mktemp("online")
    target = write_tiny_model(root / "t", num_hidden_layers=4, seed=1)
    draft = write_tiny_model(root / "d", num_hidden_layers=2, hidden_size=32, seed=1)
    return load_model(str(target)), load_model(str(draft))


@pytest.fixture(scope="module")
def target(models) -> LoadedModel:
    return models[0]


def reply(session: ChatSession, messages, **kw) -> tuple[list[int], Finished]:
    """(the committed ids, prompt and reply, and the Finished event) of one reply."""
    prompt = session.encode(messages)
    events = list(session.generate(messages, GenerateOptions(**kw)))
    fin = events[-1]
    assert isinstance(fin, Finished)
    return prompt + list(fin.token_ids), fin


def teacher_forced(target: LoadedModel, ids: list[int], layers) -> tuple[np.ndarray, ...]:
    """Features and top-k of one pass over `ids` (the reference the buffer must equal)."""
    capture: dict = dict.fromkeys(layers)
    logits = target.model(mx.array([ids]), cache=make_caches(target.model.n_layers),
                          capture=capture)
    feats = mx.concatenate([capture[i] for i in layers], axis=-1)[0]
    top_ids, top_p = topk_probs(logits[0], TOP_K)
    return np.array(feats), np.array(top_ids), np.array(top_p)


def assert_same_distribution(got_ids, got_p, want_ids, want_p) -> None:
    """Top-k sets as {id: p} (argpartition leaves them unordered), per position."""
    for gi, gp, wi, wp in zip(got_ids, got_p, want_ids, want_p, strict=True):
        got = dict(zip(gi.tolist(), gp.astype(np.float32).tolist(), strict=True))
        want = dict(zip(wi.tolist(), wp.tolist(), strict=True))
        assert set(got) == set(want)
        assert np.allclose([got[i] for i in want], list(want.values()), atol=2e-3)


@pytest.mark.parametrize("kw", [
    {"drafter": "none"},
    # draft trees: accepted paths through runner-up branches are gathered into place
    {"drafter": "model", "k": 4},
    {"drafter": "layerskip", "k": 3, "accept": "rejection",
     "sampling": SamplingParams(temperature=0.8, seed=3)},
], ids=["plain", "model-trees", "layerskip-rejection"])
def test_buffer_holds_the_committed_positions_as_a_teacher_forced_pass_sees_them(
        models, tmp_path: Path, kw) -> None:
    target, draft = models
    buffer = OnlineBuffer(tmp_path / "buf")
    session = ChatSession(target, draft, online=buffer)
    layers = session.feature_layers
    first, fin1 = reply(session, PROMPT, max_tokens=20, **kw)
    follow = [*PROMPT, {"role": "assistant", "content": fin1.text},
              {"role": "user", "content": "And then?"}]
    second, fin2 = reply(session, follow, max_tokens=20, **kw)  # reuses the cached prefix
    if kw["drafter"] != "none":
        drafted = fin1.stats.n_drafted + fin2.stats.n_drafted
        assert drafted > fin1.stats.n_accepted + fin2.stats.n_accepted  # some were rejected
    samples = buffer.samples()
    assert [s.id for s in samples] == [reply_id(fin1.text), reply_id(fin2.text)]
    for s, ids, fin, msgs in ((samples[0], first, fin1, PROMPT), (samples[1], second, fin2,
                                                                   follow)):
        n_prompt = len(session.encode(msgs))
        # committed positions only: from the last prompt token to the reply's next-to-last
        assert len(s.features) == len(fin.token_ids) and s.start == 0
        assert s.tokens.tolist() == ids[n_prompt - 1:]
        feats, top_ids, top_p = teacher_forced(target, ids[:-1], layers)
        rows = slice(n_prompt - 1, len(ids) - 1)
        np.testing.assert_allclose(s.features.astype(np.float32), feats[rows], atol=2e-2,
                                   rtol=1e-2)
        assert_same_distribution(s.top_ids, s.top_p, top_ids[rows], top_p[rows])
    assert buffer.positions == len(fin1.token_ids) + len(fin2.token_ids)


def test_nothing_is_recorded_when_off(target: LoadedModel, tmp_path: Path) -> None:
    session = ChatSession(target)
    reply(session, PROMPT, max_tokens=8)
    assert target.model.feature_taps.find_all(session.caches_tgt[0]) == []
    buffer = OnlineBuffer(tmp_path / "buf")
    session.set_online(buffer)
    assert isinstance(target.model.feature_taps.find_all(session.caches_tgt[0])[0], OnlineTap)
    reply(session, PROMPT, max_tokens=8)
    assert buffer.positions == 8
    session.set_online(None)  # switched off again: no tap, no new positions
    reply(session, [*PROMPT, {"role": "assistant", "content": "x"},
                    {"role": "user", "content": "more"}], max_tokens=8)
    buffer.flush()
    assert buffer.positions == 8
    assert target.model.feature_taps.find_all(session.caches_tgt[0]) == []


def fake(n: int, i: int) -> Sample:
    rng = np.random.default_rng(i)
    return Sample(f"online:{i}", rng.integers(0, 50, n + 1).astype(np.int32),
                  rng.standard_normal((n, 6)).astype(np.float16),
                  rng.integers(0, 50, (n, TOP_K)).astype(np.int32),
                  rng.random((n, TOP_K)).astype(np.float16), 0, False)


def test_buffer_is_bounded_and_drops_the_oldest(tmp_path: Path) -> None:
    buffer = OnlineBuffer(tmp_path / "buf", max_positions=25)
    for i in range(6):
        buffer.add(fake(10, i))
    buffer.flush()
    assert buffer.positions == 20  # a third segment of 10 would pass the cap
    assert [s.id for s in buffer.samples()] == ["online:4", "online:5"]
    assert sorted(p.name for p in (tmp_path / "buf").glob("seg-*")) == ["seg-00000005",
                                                                       "seg-00000006"]
    reopened = OnlineBuffer(tmp_path / "buf", max_positions=25)
    assert reopened.positions == 20 and reopened.last_seq == 6
    assert reopened.positions_since(5) == 10


def test_two_writers_on_one_folder_share_its_numbers_and_its_cap(tmp_path: Path) -> None:
    """The app and `chat --learn` may record into one buffer: each writer catches up with
    the other's segments before it numbers its own, and the cap counts both. (Each buffer
    alone numbered from its own scan: the second writer took seg-1 again and lost its
    reply to "could not write".)"""
    folder = tmp_path / "buf"
    problems: list[str] = []
    app = OnlineBuffer(folder, max_positions=35, on_problem=problems.append)
    cli = OnlineBuffer(folder, max_positions=35, on_problem=problems.append)
    for i in range(4):
        (app if i % 2 == 0 else cli).add(fake(10, i))
        app.flush()
        cli.flush()
    assert problems == []
    names = sorted(p.name for p in folder.glob("seg-*"))
    assert names == ["seg-00000002", "seg-00000003", "seg-00000004"]  # 40 > 35: one went
    assert [s.id for s in app.samples()] == ["online:1", "online:2", "online:3"]
    assert [s.id for s in cli.samples()] == ["online:1", "online:2", "online:3"]
    assert app.positions == cli.positions == 30 and app.last_seq == cli.last_seq == 4


def test_two_processes_record_into_one_buffer_at_once(tmp_path: Path) -> None:
    """Two processes writing side by side: every reply lands under its own number."""
    folder = tmp_path / "buf"
    script = (
        "import sys, time; from pathlib import Path\n"
        "from tests.engine.test_online import fake\n"
        "from engine.training.online import OnlineBuffer\n"
        "problems = []\n"
        "buf = OnlineBuffer(Path(sys.argv[1]), on_problem=problems.append)\n"
        "first = int(sys.argv[2])\n"
        "(Path(sys.argv[1]).parent / f'ready-{first}').touch()\n"
        "while len(list(Path(sys.argv[1]).parent.glob('ready-*'))) < 2:\n"
        "    time.sleep(0.01)\n"
        "for i in range(first, first + 12):\n"
        "    buf.add(fake(8, i))\n"
        "    time.sleep(0.005)\n"
        "buf.close()\n"
        "print(len(problems), problems)\n"
    )
    root = Path(__file__).resolve().parents[2]
    procs = [subprocess.Popen([sys.executable, "-c", script, str(folder), str(first)],
                              cwd=root, stdout=subprocess.PIPE, text=True)
             for first in (0, 100)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [o.split()[0] for o in outs] == ["0", "0"], outs
    samples = OnlineBuffer(folder).samples()
    assert sorted(s.id for s in samples) == sorted(
        f"online:{i}" for first in (0, 100) for i in range(first, first + 12))
    assert len(list(folder.glob("seg-*"))) == 24


READ_UNDER_A_LIMIT = (
    "import resource, sys; from pathlib import Path\n"
    "from tests.engine.test_online import fake\n"
    "from engine.errors import EngineError\n"
    "from engine.training.online import OnlineBuffer\n"
    "folder, hard = Path(sys.argv[1]), sys.argv[2] == 'hard'\n"
    "buf = OnlineBuffer(folder)\n"
    "for i in range(150):\n"
    "    buf.add(fake(4, i))\n"
    "buf.close()\n"
    "_, top = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
    "resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64 if hard else top))\n"
    "problems = []\n"
    "try:\n"
    "    n = len(OnlineBuffer(folder, on_problem=problems.append).samples())\n"
    "except EngineError as e:\n"
    "    n = str(e)\n"
    "print(repr((n, resource.getrlimit(resource.RLIMIT_NOFILE)[0], problems)))\n"
)


@pytest.mark.parametrize("hard", [False, True], ids=["soft-limit", "hard-limit"])
def test_more_segments_than_the_open_file_limit_lose_nothing(tmp_path: Path,
                                                             hard: bool) -> None:
    """Each loaded segment holds its features file open. A macOS process starts with room
    for 256: the buffer raises its soft limit, and where the hard one forbids that, says
    so in one line and sets no good segment aside as damaged."""
    folder = tmp_path / "buf"
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", READ_UNDER_A_LIMIT, str(folder),
                          "hard" if hard else "soft"], cwd=root, capture_output=True,
                         text=True, timeout=120, check=True).stdout
    n, limit, problems = eval(out)  # noqa: S307 - our own subprocess's repr
    assert problems == []
    assert len(list(folder.glob("seg-*[0-9]"))) == 150 and not list(folder.glob("*.damaged"))
    if hard:
        assert limit == 64
        assert "too many open files to read the training data" in n and "intact" in n
    else:
        assert limit > 150 and n == 150


def test_damaged_segment_is_set_aside_with_one_line_and_the_chat_goes_on(
        target: LoadedModel, tmp_path: Path) -> None:
    folder = tmp_path / "buf"
    buffer = OnlineBuffer(folder)
    buffer.add(fake(5, 0))
    buffer.add(fake(5, 1))
    buffer.close()
    (folder / "seg-00000001" / "meta.json").write_text("{not json")
    problems: list[str] = []
    buffer = OnlineBuffer(folder, on_problem=problems.append)
    assert len(problems) == 1 and "seg-00000001" in problems[0]
    assert "set aside" in problems[0]
    assert (folder / "seg-00000001.damaged").is_dir()
    assert buffer.positions == 5
    session = ChatSession(target, online=buffer)
    _, fin = reply(session, PROMPT, max_tokens=6)
    assert fin.stats.finish_reason == "length"
    assert [s.id for s in buffer.samples()] == ["online:1", reply_id(fin.text)]
    assert len(problems) == 1


def test_history_trains_from_the_buffer_and_reads_the_rest(target: LoadedModel,
                                                           tmp_path: Path) -> None:
    root = tmp_path / "head"
    session = ChatSession(target)
    buffer = OnlineBuffer(online_dir(root, session.feature_layers))
    session.set_online(buffer)
    # several recorded replies (one in ten is held out by its id)
    recorded = []
    for i, text in enumerate(["Hello world!", "The quick brown fox", "What is it?",
                              "def add(a, b):", "The cat sat."]):
        msgs = [{"role": "user", "content": text}]
        _, fin = reply(session, msgs, max_tokens=12 + i)
        recorded.append((*msgs, {"role": "assistant", "content": fin.text}))
    buffer.flush()
    unrecorded = ({"role": "user", "content": "Tell me more"},
                  {"role": "assistant", "content": "Sure, here is more about the fox."})
    options = TrainOptions(minutes=5, data="history",
                           conversations=(*recorded, unrecorded), max_steps=3,
                           fit=FitOptions(batch_size=2, window=32))
    progress = list(train_drafter(target, options, root=root))
    assert progress[-1].phase == "done"
    record = read_record(current_checkpoint(root))
    sources = record["sources"]
    assert sources["online_positions"] == buffer.positions
    # only the unrecorded reply was read teacher-forced
    assert 0 < sources["history_positions"] < 30
    assert record["online_seq"] == buffer.last_seq
    assert json.loads(json.dumps(record)) == record


def test_empty_buffer_and_empty_history_is_one_clear_line(target: LoadedModel,
                                                          tmp_path: Path) -> None:
    options = TrainOptions(minutes=1, data="history", conversations=())
    with pytest.raises(EngineError, match="no assistant replies"):
        next(train_drafter(target, options, root=tmp_path / "head"))
