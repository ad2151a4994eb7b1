"""``muser-kv generate`` / ``muser-kv chat`` (muser_kv.commands): mlx-lm's own
commands on muser-kv caches, driven as a user drives them.

The comparisons with mlx-lm run both commands as subprocesses of this checkout
(``sys.executable -m ...``, PYTHONPATH = the worktree) on a tiny random-weight
Muse Glimmer written to disk (``local_model``): bf16 weights, so muser-kv's
bf16 planes hold the K/V bits mlx-lm's caches hold, and 16-token windows that
the prompts plus replies wrap several times. Refusals and the speculative run
call ``muser_kv.serving.cli.main`` in this process (the same code, no process start).
"""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx_lm.utils
import numpy as np
import pytest
from local_model import write_local_model
from metal_plugin import EMULATOR_ENV

import muser_kv
from muser_kv.serving.cli import main as muser_kv_main

HERE = Path(__file__).resolve().parents[1]
ROOT = HERE.parent
WINDOW = 16  # local_model's sliding_window
PROMPT = "t5 t6 t7 t8 t9 t10"  # + the template's generation prompt t1: 7 tokens
PROMPT_TOKENS = 7
TURNS = ("t5 t6 t7 t8", "t9 t10 t11")  # 5 and 4 tokens with the generation prompt
TIMEOUT = 120
# (the package's ``mlx_lm.generate`` attribute is the function: ask for the module)
GENERATE = importlib.import_module("mlx_lm.generate")

# A child started with -m cannot install the Metal emulator; the emulated run
# covers the kernels through the in-process tests of this file and the others.
subprocess_test = pytest.mark.skipif(
    bool(os.environ.get(EMULATOR_ENV)),
    reason="the emulated-Metal run cannot route a `python -m` child through the emulator")


#: the commands compared with mlx-lm's own text attend as mlx-lm does (MLX's
#: attention): muser-kv's own gives the same tokens only within rounding
#: (tests/models/test_conformance.py compares those logits)
AS_MLX_LM = {"MUSER_KV_ATTENTION": "mlx"}


def python(*args: str, stdin: str | None = None,
           env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, **(env_extra or {}))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return subprocess.run([sys.executable, *args], input=stdin, capture_output=True, text=True,
                          timeout=TIMEOUT, env=env, cwd=ROOT)


def ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def masked(text: str) -> str:
    """The output with its timings and memory figures (every decimal) masked."""
    return re.sub(r"\d+\.\d+", "#", text)


def generated(stdout: str) -> str:
    """The text mlx-lm's generate prints between its two ===== lines."""
    m = re.search(r"^==========\n(.*)\n==========$", stdout, re.S | re.M)
    assert m, f"no generation in:\n{stdout}"
    return m.group(1)


def replies(stdout: str) -> list:
    """mlx-lm chat's replies: the streamed line above each turn's statistics."""
    lines = stdout.splitlines()
    return [lines[i - 1] for i, line in enumerate(lines) if re.search(r"\d+ tokens · ", line)]


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(
        a.view(np.uint8), b.view(np.uint8))


def generate_args(model: Path, *extra: str, tokens: int = 40, prompt: str = PROMPT) -> list:
    return ["generate", "--model", str(model), "--prompt", prompt, "--max-tokens", str(tokens),
            "--temp", "0", *extra]


# -- generate -----------------------------------------------------------------------------


@subprocess_test
def test_generate_prints_what_mlx_lm_prints_past_the_wrap(local_muse_model, tmp_path):
    session = tmp_path / "generate.safetensors"
    ref = ok(python("-m", "mlx_lm", *generate_args(local_muse_model)))
    ours = ok(python("-m", "muser_kv", *generate_args(local_muse_model),
                     "--session", str(session), env_extra=AS_MLX_LM))
    assert masked(ours) == masked(ref)
    assert len(generated(ours).split()) == 40
    # the text came through muser-kv's caches: they are what the session holds
    snapshot = muser_kv.read_session(session)
    assert snapshot.position == PROMPT_TOKENS + 40 > 2 * WINDOW
    assert snapshot.encoding == "bf16le"



@subprocess_test
@pytest.mark.parametrize("command", ["generate", "chat"])
def test_the_session_saved_line_starts_a_line_of_its_own(local_muse_model, tmp_path, command):
    """stdout and stderr on one screen (a terminal): the streamed reply ends
    its line only after the stream, so the save's line must start its own,
    not glue onto the last generated word; stdout stays mlx-lm's."""
    session = tmp_path / f"{command}.safetensors"
    argv = (generate_args(local_muse_model, tokens=8) if command == "generate" else
            ["chat", "--model", str(local_muse_model), "--max-tokens", "8"])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    screen = subprocess.run(
        [sys.executable, "-m", "muser_kv", *argv, "--session", str(session)],
        input=f"{TURNS[0]}\nq\n" if command == "chat" else None, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, timeout=TIMEOUT, env=env, cwd=ROOT)
    assert screen.returncode == 0, screen.stdout
    lines = screen.stdout.splitlines()
    at = [i for i, line in enumerate(lines) if "session saved to" in line]
    assert len(at) == 1, screen.stdout
    assert lines[at[0]].startswith(f"muser-kv: session saved to {session} ("), screen.stdout
    assert re.fullmatch(r"(t\d+ ?)+", lines[at[0] - 1]), screen.stdout  # the reply, whole
    assert len(lines[at[0] - 1].split()) == 8


def test_generate_resumes_a_session_file(local_muse_model, tmp_path, capsys):
    session = tmp_path / "resumed.safetensors"
    assert muser_kv_main(generate_args(local_muse_model, "--session", str(session),
                                       tokens=20)) == 0
    first = muser_kv.read_session(session)
    assert first.position == PROMPT_TOKENS + 20
    assert muser_kv_main(generate_args(local_muse_model, "--session", str(session),
                                       tokens=10, prompt="t3 t4")) == 0
    second = muser_kv.read_session(session)
    assert second.position == first.position + 3 + 10  # "t3 t4 t1", 10 replies, after it
    for layer, (a, b) in enumerate(zip(first.layers, second.layers)):
        if first.geometry.layer_kind(layer) is muser_kv.LayerKind.GLOBAL:  # holds every row
            for old, new in ((a.keys, b.keys), (a.values, b.values)):
                assert same_bits(np.array(old.astype(mx.float32)),
                                 np.array(new[:first.position].astype(mx.float32)))
    assert "session saved to" in capsys.readouterr().err


def test_generate_with_a_kv_store_rebuilds_the_prompt_the_second_time(local_muse_model, tmp_path,
                                                                      capsys):
    """The first run prefills the prompt less its last token and puts it; the
    second rebuilds it from the directory (one token left to prefill) and
    prints the same text: the same state, the same greedy tokens."""
    store = tmp_path / "store"
    assert muser_kv_main(generate_args(local_muse_model, "--kv-store", str(store))) == 0
    first = capsys.readouterr()
    assert "rebuilt from the KV store" not in first.err
    assert muser_kv_main(generate_args(local_muse_model, "--kv-store", str(store))) == 0
    second = capsys.readouterr()
    assert f"{PROMPT_TOKENS - 1} of the prompt's {PROMPT_TOKENS} tokens rebuilt" in second.err
    assert generated(second.out) == generated(first.out)
    assert len(generated(first.out).split()) == 40
    assert muser_kv_main(generate_args(local_muse_model, "--kv-store", str(store),
                                       "--session", str(tmp_path / "s.safetensors"))) == 1
    assert "--kv-store and --session" in capsys.readouterr().err


# -- chat -----------------------------------------------------------------------------------


@subprocess_test
def test_chat_matches_mlx_lm_and_a_resumed_session_replays_bit_for_bit(local_muse_model,
                                                                       tmp_path):
    chat = ["chat", "--model", str(local_muse_model), "--max-tokens", "30"]
    both = "\n".join(TURNS) + "\nq\n"
    ref = ok(python("-m", "mlx_lm", *chat, stdin=both))

    def spec(name: str, stdin: str, session: Path) -> dict:
        return {"argv": chat + ["--session", str(session)], "stdin": stdin,
                "stdout": str(tmp_path / f"{name}.out"), "record": str(tmp_path / f"{name}.npz")}

    whole, split = tmp_path / "whole.safetensors", tmp_path / "split.safetensors"
    runs = [spec("whole", both, whole), spec("first", TURNS[0] + "\nq\n", split)]
    ok(python(str(HERE / "commands_child.py"), json.dumps(runs), env_extra=AS_MLX_LM))
    after_first = muser_kv.read_session(split)
    runs.append(spec("second", TURNS[1] + "\nq\n", split))  # a new process resumes it
    ok(python(str(HERE / "commands_child.py"), json.dumps(runs[2:]), env_extra=AS_MLX_LM))

    out = {s["record"]: Path(s["stdout"]).read_text() for s in runs}
    rec = {s["record"]: np.load(s["record"]) for s in runs}
    whole_out, first_out, second_out = (out[s["record"]] for s in runs)
    whole_rec, first_rec, second_rec = (rec[s["record"]] for s in runs)
    assert all(int(r["rc"]) == 0 for r in rec.values())

    # the same tokens, the same screen as mlx-lm's chat
    assert masked(whole_out) == masked(ref)
    turn1, turn2 = replies(whole_out)
    assert len(turn1.split()) == 30 and len(turn2.split()) >= 8
    assert replies(first_out) == [turn1] and replies(second_out) == [turn2]

    # turn 2 resumed in another process: every response bit for bit
    n = len(first_rec["tokens"])
    assert np.array_equal(whole_rec["tokens"], np.concatenate([first_rec["tokens"],
                                                               second_rec["tokens"]]))
    assert same_bits(whole_rec["logprobs"][:n], first_rec["logprobs"])
    assert same_bits(whole_rec["logprobs"][n:], second_rec["logprobs"])

    # the saved sessions: turn 1 ends past the wrap; the files hold the same cache
    assert after_first.position == 5 + 30 > 2 * WINDOW
    a, b = muser_kv.read_session(whole), muser_kv.read_session(split)
    assert a.position == b.position > after_first.position
    for x, y in zip(a.layers, b.layers):
        assert x.start == y.start
        assert same_bits(np.array(x.keys.astype(mx.float32)), np.array(y.keys.astype(mx.float32)))
        assert same_bits(np.array(x.values.astype(mx.float32)),
                         np.array(y.values.astype(mx.float32)))


# -- speculative ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def f32_pair(tmp_path_factory):
    """A model and a draft of the same shape but other weights (seed 1): the
    draft's tokens are rejected, so a round rolls back as many rows as it
    drafted. f32 weights: mlx-lm's verify (many tokens in one forward) and
    decode (one) then give the same argmax; with bf16 weights they tie, and on
    this geometry split at token 28 with mlx-lm's own caches too."""
    root = tmp_path_factory.mktemp("speculative")
    return (write_local_model(root / "model", dtype="float32"),
            write_local_model(root / "draft", dtype="float32", seed=1))


# 25 prompt tokens: every round starts past the wrap; 22 replies: the first
# rounds draft 20 tokens (mlx-lm drafts min(max_tokens - done, N)) and roll
# back 20 rows of the model's cache and 19 of the draft's, more than the
# `--retain 16` these tests ask for: the command must size retain from the draft
LONG_PROMPT = " ".join(f"t{i}" for i in range(30, 54))
SPECULATIVE_TOKENS = 22


def test_speculative_with_20_draft_tokens_prints_the_greedy_text(f32_pair, capsys):
    model, draft = f32_pair
    assert muser_kv_main(generate_args(model, tokens=SPECULATIVE_TOKENS,
                                       prompt=LONG_PROMPT)) == 0
    plain = generated(capsys.readouterr().out)
    assert muser_kv_main(generate_args(model, "--retain", "16", "--draft-model", str(draft),
                                       "--num-draft-tokens", "20", tokens=SPECULATIVE_TOKENS,
                                       prompt=LONG_PROMPT)) == 0
    out = capsys.readouterr()
    assert generated(out.out) == plain and len(plain.split()) == SPECULATIVE_TOKENS
    assert "keeps mlx-lm's caches" not in out.err  # the draft got muser-kv caches too


def test_a_draft_muser_kv_does_not_serve_keeps_mlx_lms_caches(f32_pair, tmp_path, capsys):
    draft = write_local_model(tmp_path / "llama", model_type="llama", dtype="float32")
    args = generate_args(f32_pair[0], tokens=8)
    assert muser_kv_main(args) == 0
    plain = generated(capsys.readouterr().out)
    assert muser_kv_main(args + ["--draft-model", str(draft), "--num-draft-tokens", "4"]) == 0
    out = capsys.readouterr()
    assert generated(out.out) == plain
    assert f"draft model {draft} keeps mlx-lm's caches (not a model muser-kv serves" in out.err


def test_the_same_rollbacks_refuse_a_cache_not_sized_for_them(f32_pair):
    """The negative control: rings retaining 16 rows (what the commands would
    build without sizing retain from the draft) cannot undo this pair's 20-row
    rollbacks past the wrap, and say so."""
    model, tokenizer = mlx_lm.utils.load(str(f32_pair[0]))
    draft, _ = mlx_lm.utils.load(str(f32_pair[1]))
    muser_kv.install(model, retain=16)
    muser_kv.install(draft, retain=16)
    prompt = tokenizer.encode(LONG_PROMPT + " t1", add_special_tokens=False)
    with pytest.raises(ValueError, match="can trim at most 16 tokens exactly, asked for 20"):
        for _ in GENERATE.stream_generate(model, tokenizer, prompt,
                                          max_tokens=SPECULATIVE_TOKENS, draft_model=draft,
                                          num_draft_tokens=20):
            pass


# -- refusals -------------------------------------------------------------------------------


@subprocess_test
def test_a_model_muser_kv_does_not_serve_is_one_line_and_exit_1(tmp_path):
    llama = write_local_model(tmp_path / "llama", model_type="llama")
    proc = python("-m", "muser_kv", *generate_args(llama, tokens=4))
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    line, = proc.stderr.strip().splitlines()
    assert line.startswith(f"muser-kv generate: {llama} is not a model muser-kv serves")
    assert "has no sliding-window layers" in line and "model_type 'llama'" in line


@pytest.mark.parametrize("extra, message", [
    (["--max-kv-size", "64"], "use --max-context 64"),
    (["--kv-bits", "4"], "--kv-bits 4 is refused"),
    (["--session", "s.safetensors", "--prompt-cache-file", "p.safetensors"], "pass one of them"),
    (["--session", "/nonexistent/dir/s.safetensors"], "directory /nonexistent/dir does not exist"),
], ids=["max-kv-size", "kv-bits", "session-and-prompt-cache", "session-dir"])
def test_flags_muser_kv_would_change_are_refused_before_loading(extra, message, capsys):
    # a model path that does not exist: the refusal comes before any load
    assert muser_kv_main(generate_args(Path("/nonexistent/model"), *extra)) == 1
    err = capsys.readouterr().err
    assert err.startswith("muser-kv generate: ") and message in err and err.count("\n") == 1


def test_chat_refuses_max_kv_size_too(capsys):
    assert muser_kv_main(["chat", "--model", "/nonexistent", "--max-kv-size", "8"]) == 1
    assert "use --max-context 8" in capsys.readouterr().err


def test_retain_0_with_drafts_is_refused(local_muse_model, capsys):
    assert muser_kv_main(generate_args(local_muse_model, "--retain", "0", "--draft-model",
                                       str(local_muse_model), tokens=4)) == 1
    err = capsys.readouterr().err
    assert "retain=0" in err and "num_draft_tokens=3" in err  # mlx-lm's default draft length


def test_a_session_from_another_model_is_refused(local_muse_model, f32_pair, tmp_path, capsys):
    session = tmp_path / "other.safetensors"
    assert muser_kv_main(generate_args(local_muse_model, "--session", str(session),
                                       tokens=4)) == 0
    saved = session.read_bytes()
    capsys.readouterr()
    assert muser_kv_main(generate_args(f32_pair[0], "--session", str(session),
                                       "--plane-dtype", "bfloat16", tokens=4)) == 1
    out = capsys.readouterr()
    assert "another model" in out.err and out.err.startswith(f"muser-kv generate: --session {session}")
    assert out.out == "" and session.read_bytes() == saved


def test_a_context_overflow_stops_with_one_line_and_writes_no_session(local_muse_model,
                                                                       tmp_path, capsys):
    session = tmp_path / "full.safetensors"
    assert muser_kv_main(generate_args(local_muse_model, "--max-context", "24",
                                       "--session", str(session))) == 1
    err = capsys.readouterr().err
    assert "exceeds max_context 24" in err and "pass a larger --max-context" in err
    assert not session.exists()


# -- the command itself ---------------------------------------------------------------------


@pytest.mark.parametrize("command, theirs", [("generate", "--num-draft-tokens"),
                                              ("chat", "--system-prompt")])
def test_help_is_mlx_lms_with_muser_kvs_flags(command, theirs, capsys):
    with pytest.raises(SystemExit) as e:
        muser_kv_main([command, "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith(f"usage: muser-kv {command}")
    for flag in (theirs, "--max-kv-size", "--max-context", "--retain", "--plane-dtype",
                 "--session"):
        assert flag in text


def test_a_run_leaves_mlx_lm_as_it_found_it(local_muse_model, capsys):
    before = (GENERATE.load, GENERATE.stream_generate,
              GENERATE.setup_arg_parser, list(sys.argv))
    assert muser_kv_main(generate_args(local_muse_model, "--session",
                                       "/nonexistent/s.safetensors")) == 1
    assert muser_kv_main(generate_args(local_muse_model, tokens=2)) == 0
    assert (GENERATE.load, GENERATE.stream_generate,
            GENERATE.setup_arg_parser, sys.argv) == before


# -- prompt-cache files --------------------------------------------------------------------


def test_cache_prompt_then_generate_from_the_file(local_muse_model, tmp_path, capsys):
    """``muser-kv cache-prompt`` writes mlx-lm's prompt-cache file of muser-kv
    caches (the prefix past the wrap); ``muser-kv generate --prompt-cache-file``
    continues from it with what mlx-lm's own API gives from the same file."""
    from mlx_lm.models.cache import load_prompt_cache

    path = tmp_path / "prefix.safetensors"
    prefix = " ".join(f"t{i}" for i in range(30, 60))
    assert muser_kv_main(["cache-prompt", "--model", str(local_muse_model), "--prompt", prefix,
                          "--prompt-cache-file", str(path)]) == 0
    capsys.readouterr()
    cache, meta = load_prompt_cache(str(path), return_metadata=True)
    assert isinstance(cache[0], muser_kv.SlidingKVCache) and cache[0].ring.wrapped
    assert meta["model"] == str(local_muse_model)
    assert muser_kv_main(["generate", "--model", str(local_muse_model), "--prompt-cache-file",
                          str(path), "--prompt", "t5 t6", "--max-tokens", "20", "--temp",
                          "0"]) == 0
    ours = generated(capsys.readouterr().out)
    model, tokenizer = mlx_lm.utils.load(str(local_muse_model))
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "t5 t6"}],
                                        add_generation_prompt=True)
    ref = [r.token for r in GENERATE.stream_generate(model, tokenizer, ids, max_tokens=20,
                                                      prompt_cache=load_prompt_cache(str(path)))]
    assert ours == tokenizer.decode(ref)


@pytest.mark.parametrize("argv", [["--help"], ["serve", "--help"], ["generate", "--help"],
                                  ["chat", "--help"], ["cache-prompt", "--help"]],
                         ids=lambda a: " ".join(a))
def test_help_names_modules_that_exist_and_promises_no_preallocated_caches(argv, capsys):
    """Every module a --help names can be imported; and none says the caches
    are preallocated: by default their global planes grow (``preallocate=True``
    is make_prompt_cache's choice, not the commands')."""
    with pytest.raises(SystemExit) as e:
        muser_kv_main(argv)
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps at spaces
    names = re.findall(r"\b(?:muser_kv|mlx_lm)(?:\.\w+)+", text)
    if argv == ["--help"]:
        assert {"muser_kv.serving.commands", "muser_kv.serving.server.serve"} <= set(names)
    for name in names:
        assert exists(name), f"{name} (in muser-kv {' '.join(argv)})"
    assert "preallocated" not in text


def exists(dotted: str) -> bool:
    """Whether ``dotted`` is a module, or a name in one."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attribute in parts[cut:]:
            if not hasattr(found, attribute):
                return False
            found = getattr(found, attribute)
        return True
    return False


def test_the_package_description_promises_no_preallocated_caches():
    text = (ROOT / "pyproject.toml").read_text()
    description = re.search(r'^description = "(.*)"$', text, re.M)
    assert description is not None
    for words in (description.group(1), muser_kv.__doc__.splitlines()[0]):
        assert "KV caches" in words and "preallocated" not in words, words
