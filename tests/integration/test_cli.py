"""The `rag-kvcache` command on a tiny random Llama saved to disk (loaded like any local model)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from importlib.resources import files
from typing import Literal

import pytest
import torch
import typer
from pydantic import BaseModel, Field, ValidationError
from rich.filesize import decimal
from test_serve import CHATML
from tiny_model import tiny_llama
from transformers import AutoTokenizer
from typer.testing import CliRunner

import rag_kvcache
from rag_kvcache.cli import app
from rag_kvcache.config import Config, FusionConfig, GenerationConfig, IndexSettings, RuntimeConfig
from rag_kvcache.index import KVIndex
from rag_kvcache.store.codecs import CODECS

runner = CliRunner()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer):
    path = tmp_path_factory.mktemp("tiny-model")
    tiny_llama().save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def built(tmp_path_factory, model_dir):
    root = tmp_path_factory.mktemp("cli")
    docs = root / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("The main telescope of the Veldmark Observatory is named Harrow's Eye. " * 12)
    (docs / "b.txt").write_text("Saltmere is a mill village on the river Anvel with a bakery. " * 12)
    (docs / "blob.bin").write_bytes(b"\x00\x01\x02binary")
    (docs / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    result = runner.invoke(
        app, ["index", str(docs), "--index", str(root / "idx"), "--chunk-tokens", "128", "--model", str(model_dir)]
    )
    assert result.exit_code == 0, result.output
    return root, result.output


def test_index_reports_and_skips(built):
    _, output = built
    assert "2 added" in output and "2 skipped" in output


def test_ask_json(built, model_dir):
    root, _ = built
    result = runner.invoke(
        app,
        [
            "ask",
            "What is the telescope called?",
            "--index",
            str(root / "idx"),
            "--json",
            "--max-new-tokens",
            "4",
            "--top-k",
            "2",
        ],
    )
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    for key in ("answer", "method", "ttft_s", "retrieval_s", "prompt_tokens", "recomputed_tokens", "chunks"):
        assert key in out
    assert out["method"] == "epic_match" and out["chunks"][0]["source"] == "a.txt"  # the default
    assert set(out["chunks"][0]) == {"id", "source", "score"}


def test_ask_text_and_methods(built):
    root, _ = built
    for method in ("full", "prefix", "reuse", "epic"):
        result = runner.invoke(
            app, ["ask", "Saltmere?", "--index", str(root / "idx"), "--method", method, "--max-new-tokens", "3"]
        )
        assert result.exit_code == 0, result.output
        assert f"{method}: ttft" in result.output


def test_ask_cacheblend_knobs(built):
    root, _ = built
    base = [
        "ask",
        "What is the telescope called?",
        "--index",
        str(root / "idx"),
        "--json",
        "--max-new-tokens",
        "2",
        "--top-k",
        "2",
        "--method",
        "cacheblend",
        "--ratio",
        "0.2",
    ]
    one_step = runner.invoke(app, base)
    gradual = runner.invoke(app, [*base, "--filter-steps", "3", "--deviation", "v"])
    assert one_step.exit_code == 0 and gradual.exit_code == 0, gradual.output
    # gradual filtering starts wider and ends at --ratio: the same number of tokens reach the last layer
    assert json.loads(gradual.stdout)["recomputed_tokens"] == json.loads(one_step.stdout)["recomputed_tokens"]
    result = runner.invoke(app, [*base, "--check-layer", "2", "--filter-steps", "3"])
    assert result.exit_code == 2 and "filter_steps must be at most 2 (the model's 4 layers" in " ".join(
        result.output.split()
    )


@pytest.mark.parametrize(
    "args,message",
    [
        (["ask", "  ", "--index", "IDX"], "the question is empty"),
        (["ask", "q", "--index", "MISSING"], "not found"),
        (["ask", "q", "--index", "MISSING"], "make one with `rag-kvcache index DOCS --index"),  # names the command
        (["index", "MISSING", "--index", "IDX"], "MISSING"),
    ],
)
def test_bad_input_is_a_clear_error(built, tmp_path, args, message):
    root, _ = built
    args = [str(root / "idx") if a == "IDX" else str(tmp_path / "missing") if a == "MISSING" else a for a in args]
    message = str(tmp_path / "missing") if message == "MISSING" else message
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    assert message in " ".join(result.output.split())  # rich may wrap long lines


def test_device_and_dtype_reach_every_model_command(built, model_dir, tmp_path):
    """--device/--dtype come from Config's fields; an index records its dtype, is read in it, refuses
    another at re-indexing, and `ask --dtype` in another misses every cached chunk."""
    group = typer.main.get_command(app)
    helps = {
        name: cls.__dataclass_fields__[name].metadata["help"]
        for name, cls in (("device", RuntimeConfig), ("dtype", IndexSettings))
    }
    for command in ("index", "ask", "bench", "calibrate", "demo", "serve"):
        params = {p.name: p for p in group.commands[command].params}
        assert {name: params[name].help for name in helps} == helps, command
    from rag_kvcache.index import KVIndex

    root, _ = built
    idx = tmp_path / "bf16"
    made = runner.invoke(
        app,
        [
            "index",
            str(root / "docs"),
            "--index",
            str(idx),
            "--chunk-tokens",
            "128",
            "--model",
            str(model_dir),
            "--dtype",
            "bfloat16",
            "--device",
            "cpu",
        ],
    )
    assert made.exit_code == 0, made.output
    assert KVIndex.config_of(idx).index.dtype == "bfloat16"
    again = runner.invoke(app, ["index", str(root / "docs"), "--index", str(idx), "--dtype", "float32"])
    assert again.exit_code == 2 and "dtype='bfloat16'" in " ".join(again.output.split())
    ask = ["ask", "Saltmere?", "--index", str(idx), "--json", "--max-new-tokens", "2", "--top-k", "2"]
    same, other = runner.invoke(app, ask), runner.invoke(app, [*ask, "--dtype", "float32", "--device", "cpu"])
    assert same.exit_code == 0 and other.exit_code == 0, other.output
    assert json.loads(same.stdout)["cache_misses"] == 0
    assert json.loads(other.stdout)["cache_misses"] == 2  # float32 caches are other entries than bfloat16's


def test_model_commands_turn_cudnn_attention_off(built):
    # the CLI is the edge that sets it: cuDNN's SDPA plans every new sequence length (a prefill 100 -> 22 ms on an H100)
    root, _ = built
    before = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(True)
    try:
        result = runner.invoke(app, ["ask", "Saltmere?", "--index", str(root / "idx"), "--max-new-tokens", "1"])
        assert result.exit_code == 0, result.output
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


def test_foreign_index_is_refused(tmp_path):
    (tmp_path / "index.sqlite").write_text("hello")
    result = runner.invoke(app, ["ask", "q", "--index", str(tmp_path)])
    assert result.exit_code == 2 and "error" in result.output


# ---- issue 15: the command as a new user meets it --------------------------------------------------
def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, check=False)


def test_importing_the_cli_loads_no_heavy_library():
    """`--help` is fast because nothing heavy is imported until a command runs."""
    heavy = ("torch", "transformers", "sentence_transformers", "faiss", "matplotlib")
    proc = _run("-c", f"import sys, rag_kvcache.cli; print([m for m in {heavy!r} if m in sys.modules])")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_python_m_and_version():
    proc = _run("-m", "rag_kvcache", "--help")
    assert proc.returncode == 0, proc.stderr
    assert "Usage: rag-kvcache" in proc.stdout and "ask" in proc.stdout
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.stdout.strip() == f"rag-kvcache {rag_kvcache.__version__}"


def test_every_option_has_help_and_config_defaults():
    """Help texts are complete, and options that set a config field show that field's default."""
    group = typer.main.get_command(app)
    for name, command in group.commands.items():
        assert command.help and command.help.splitlines()[0].strip(), name
        for param in command.params:
            assert getattr(param, "help", None), f"{name} {param.name} has no help"
    ask = {p.name: p for p in group.commands["ask"].params}
    fusion, generation = FusionConfig(), GenerationConfig()
    assert ask["method"].default == fusion.method and ask["epic_k"].default == fusion.epic_k
    assert ask["match_words"].default == fusion.match_words
    assert ask["ratio"].default == str(fusion.ratio) and ask["check_layer"].default == fusion.check_layer
    assert ask["temperature"].default == generation.temperature == 0.0  # greedy unless asked
    assert ask["max_new_tokens"].default == generation.max_new_tokens and ask["top_k"].default == Config().query.top_k
    assert "sample" not in ask  # one rule: sampling iff temperature > 0
    result = runner.invoke(app, ["index", "--help"], terminal_width=200)
    assert f"[default: {Config().index.chunk_tokens}; x>=16]" in result.stdout  # no markup eats the brackets
    assert "|".join(CODECS) in result.stdout  # the codec registry's names


def test_help_lists_the_builtin_methods_and_bench_defaults_match_the_runner():
    from rag_kvcache.bench.variants import DEFAULT_METHODS, BenchSettings
    from rag_kvcache.config import BUILTIN_METHODS
    from rag_kvcache.engine.methods import METHODS

    assert set(BUILTIN_METHODS.split(", ")) == set(METHODS)
    bench = {p.name: p for p in typer.main.get_command(app).commands["bench"].params}
    assert bench["methods"].default == ",".join(DEFAULT_METHODS)
    assert (bench["warmup"].default, bench["threads"].default) == (BenchSettings().warmup, BenchSettings().threads)


def test_a_registered_method_is_reachable_and_an_unknown_one_is_listed(built):
    from rag_kvcache.engine.methods import METHODS, register

    root, _ = built
    base = ["ask", "Saltmere?", "--index", str(root / "idx"), "--max-new-tokens", "2", "--top-k", "1"]
    register("reuse-again")(METHODS["reuse"].fn)
    try:
        result = runner.invoke(app, [*base, "--method", "reuse-again"])
        assert result.exit_code == 0, result.output
        assert "reuse-again: ttft" in result.output
    finally:
        del METHODS["reuse-again"]
    result = runner.invoke(app, [*base, "--method", "nope"])
    assert result.exit_code == 2
    assert f"unknown fusion method 'nope' (registered: {', '.join(METHODS)})" in " ".join(result.output.split())
    result = runner.invoke(app, [*base, "--method", "cacheblnd"])  # a typo: the closest name is offered
    assert result.exit_code == 2
    assert "unknown fusion method 'cacheblnd'; did you mean 'cacheblend'?" in " ".join(result.output.split())


def test_stream_json_emits_json_lines(built):
    root, _ = built
    result = runner.invoke(
        app,
        [
            "ask",
            "What is the telescope called?",
            "--index",
            str(root / "idx"),
            "--stream",
            "--json",
            "--max-new-tokens",
            "6",
            "--top-k",
            "1",
            "--method",
            "full",
        ],
    )
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    pieces, final = lines[:-1], lines[-1]
    assert pieces and all(set(p) == {"text"} for p in pieces)
    assert "".join(p["text"] for p in pieces) == final["answer"] and final["method"] == "full"


def test_sampling_follows_temperature(built):
    root, _ = built
    base = [
        "ask",
        "What is the telescope called?",
        "--index",
        str(root / "idx"),
        "--json",
        "--max-new-tokens",
        "8",
        "--top-k",
        "1",
        "--method",
        "full",
    ]
    greedy = [json.loads(runner.invoke(app, base).stdout)["answer"] for _ in range(2)]
    sampled = {
        json.loads(runner.invoke(app, [*base, "--temperature", "1.5", "--seed", str(s)]).stdout)["answer"]
        for s in range(4)
    }
    assert greedy[0] == greedy[1] and len(sampled) > 1  # a random model at T=1.5 samples away from argmax


def test_demo_data_ships_inside_the_package():
    docs = files("rag_kvcache") / "demo"
    names = sorted(p.name for p in docs.iterdir())
    assert "observatory.md" in names and all(n.endswith(".md") for n in names)


def test_without_faiss_the_error_names_both_builds():
    """faiss-cpu is a dependency a user may swap for the CUDA build: without either, opening an index
    says what to install."""
    proc = _run("-c", "import sys; sys.modules['faiss'] = None; import rag_kvcache.index")
    assert proc.returncode == 1
    assert (
        "pip install faiss-cpu, or the CUDA build in its place (pip uninstall faiss-cpu && pip install faiss-gpu-cu12)"
        in proc.stderr
    )


# ---- ask --json-schema: the answer decoded under a JSON Schema ([structured]) ------------------------------
class Telescope(BaseModel):
    name: str = Field(max_length=16)
    kind: Literal["refractor", "reflector"]
    aperture_cm: int = Field(ge=1, le=1000)


@pytest.fixture(scope="module")
def bpe_index(tmp_path_factory, bpe_tiny, built):
    """An index of `built`'s documents on the tiny Llama with a byte-level BPE tokenizer (MiniLM's
    WordPiece cannot be constrained), saved to disk and loaded as any local model."""
    pytest.importorskip("llguidance")
    root, _ = built
    model = tmp_path_factory.mktemp("bpe-model")
    bpe_tiny.model.save_pretrained(model)
    bpe_tiny.tokenizer.save_pretrained(model)
    idx = tmp_path_factory.mktemp("bpe") / "idx"
    result = runner.invoke(
        app, ["index", str(root / "docs"), "--index", str(idx), "--chunk-tokens", "128", "--model", str(model)]
    )
    assert result.exit_code == 0, result.output
    return idx


def test_ask_json_schema_answers_under_the_schema(bpe_index, tmp_path):
    schema = json.dumps(Telescope.model_json_schema())
    (tmp_path / "telescope.json").write_text(schema)
    base = [
        "ask",
        "What is the telescope called?",
        "--index",
        str(bpe_index),
        "--json",
        "--max-new-tokens",
        "120",
        "--top-k",
        "2",
    ]
    inline = runner.invoke(app, [*base, "--json-schema", schema])
    from_file = runner.invoke(app, [*base, "--json-schema", str(tmp_path / "telescope.json")])
    free = runner.invoke(app, base)
    assert inline.exit_code == 0 and from_file.exit_code == 0 and free.exit_code == 0, inline.output
    answer = json.loads(inline.stdout)["answer"]
    Telescope.model_validate_json(answer)  # a random-weight model, yet the answer is valid: the constraint did it
    assert json.loads(from_file.stdout)["answer"] == answer  # greedy: the file is the same schema
    with pytest.raises(ValidationError):  # the same model and question without the schema
        Telescope.model_validate_json(json.loads(free.stdout)["answer"])


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        ('{"type": "no-such-type"}', "cannot constrain decoding to JSON Schema"),
        ('{"type": object}', "json_schema is not JSON"),
        ("missing.json", "takes JSON text (beginning with '{') or a file; 'missing.json' is neither"),
    ],
)
def test_ask_json_schema_refuses_a_bad_schema(bpe_index, schema, message):
    result = runner.invoke(
        app, ["ask", "Saltmere?", "--index", str(bpe_index), "--max-new-tokens", "4", "--json-schema", schema]
    )
    assert result.exit_code == 2
    assert message in " ".join(result.output.split())


def test_ask_json_schema_without_the_extra_names_it(built, monkeypatch):
    root, _ = built
    monkeypatch.setitem(sys.modules, "llguidance", None)  # not importable, as where [structured] is not installed
    result = runner.invoke(
        app, ["ask", "Saltmere?", "--index", str(root / "idx"), "--json-schema", '{"type": "object"}']
    )
    assert result.exit_code == 2
    assert "--json-schema needs llguidance: pip install 'rag-kvcache[structured]'" in " ".join(result.output.split())


@pytest.mark.parametrize("empty", ["DOCS_DIR", "--index"])
def test_index_refuses_an_empty_path(tmp_path, monkeypatch, empty):
    """`index ""` meant the current directory: a silent run over whatever is there."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.txt").write_text("Some text.")
    docs, idx = ("", "idx") if empty == "DOCS_DIR" else (".", "")
    result = runner.invoke(app, ["index", docs, "--index", idx])
    assert result.exit_code == 2 and f"{empty} is empty" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt"]  # nothing indexed, nothing created


def test_a_failed_first_index_leaves_no_index_folder(tmp_path, model_dir):
    """Indexing an empty folder failed but left an empty index folder behind."""
    (tmp_path / "empty").mkdir()
    result = runner.invoke(
        app,
        [
            "index",
            str(tmp_path / "empty"),
            "--index",
            str(tmp_path / "idx"),
            "--model",
            str(model_dir),
            "--chunk-tokens",
            "32",
        ],
    )
    assert result.exit_code == 2 and not (tmp_path / "idx").exists()


def test_a_typo_of_the_default_model_fails_at_once_naming_it(tmp_path, monkeypatch):
    """`--model SmolLM2-135M` spent 54 s retrying the model hub before failing, without naming the default."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("Some text.")
    result = runner.invoke(
        app, ["index", str(tmp_path / "docs"), "--index", str(tmp_path / "idx"), "--model", "SmolLM2-135M"]
    )
    message = " ".join(result.stderr.split())
    assert result.exit_code == 2 and "did you mean 'SmolLM2-135M-Instruct'?" in message, message
    assert not (tmp_path / "idx").exists()


def test_index_says_the_caches_size_and_codec(built):
    """234 KB of documents became 3.0 GB of caches with no word before or after."""
    root, output = built
    assert "(int8k-int4v, " in output and "KiB/token)" in output and "KV caches " in output


def test_index_under_a_budget_says_the_bytes_on_disk_not_the_whole_corpus(built, model_dir, tmp_path):
    """Under `--kv-budget` the summary gave the size every chunk's caches would take (29.8 GB for a 3.4 GB
    budget), as if that were on disk: it now says the bytes the store holds, within the budget, beside it."""
    root, _ = built
    result = runner.invoke(
        app,
        [
            *("index", str(root / "docs"), "--index", str(tmp_path / "idx"), "--chunk-tokens", "128"),
            *("--model", str(model_dir), "--kv-budget", "100kB"),
        ],
    )
    assert result.exit_code == 0, result.output
    output = " ".join(result.output.split())
    index = KVIndex.open(tmp_path / "idx")
    held = index.store.ledger.stats(0).bytes
    whole = index.kv_bytes(map(len, index.chunks.token_ids()))
    index.close()
    assert 0 < held <= 100_000 < whole
    assert (
        f"KV caches {decimal(held)} on disk within the budget of 100.0 kB (every chunk's would take {decimal(whole)})"
        in output
    )


@pytest.mark.parametrize("prefill", ["grouped", "behind_prefix"])
def test_ctrl_c_during_index_keeps_its_work_and_check_and_gc_keep_it_too(tmp_path, model_dir, monkeypatch, prefill):
    """Ctrl-C during `index` exited 130 without a word; `check` then called the caches it had computed garbage
    and advised `gc`, which would have thrown away what the next run resumes with."""
    from rag_kvcache.indexing import maker, recipe

    docs = tmp_path / "docs"
    docs.mkdir()
    for i, word in enumerate(["harbour", "lighthouse", "granite", "bakery"]):
        (docs / f"{word}.txt").write_text(f"The {word} of Saltmere, number {i}, is old and well kept. " * 8)
    args = ["index", str(docs), "--index", str(tmp_path / "idx"), "--model", str(model_dir), "--chunk-tokens", "32"]
    args += ["--chunk-prefill", prefill]

    def two_then_ctrl_c(items):
        for n, item in enumerate(items):
            if n == 2:  # two chunk caches computed, then Ctrl-C
                raise KeyboardInterrupt
            yield item

    if prefill == "grouped":
        grouped = maker.compute_grouped
        monkeypatch.setattr(maker, "compute_grouped", lambda *args: two_then_ctrl_c(grouped(*args)))
    else:
        compute = recipe.CacheRecipe.compute
        monkeypatch.setattr(  # the system prefix's cache is computed behind nothing first
            recipe.CacheRecipe,
            "compute",
            lambda self, ids, ctx: two_then_ctrl_c(compute(self, ids, ctx)) if ctx else compute(self, ids, ctx),
        )
    result = runner.invoke(app, args)
    assert result.exit_code == 130 and "the 2 KV caches it computed" in " ".join(result.stderr.split())
    files = sorted((tmp_path / "idx" / "kv").rglob("*.safetensors"))
    assert len(files) == 3  # the system prefix's and two chunks'
    check = runner.invoke(app, ["check", "--index", str(tmp_path / "idx")])
    assert check.exit_code == 0 and "garbage" not in check.output and "interrupted `index` run" in check.output
    assert runner.invoke(app, ["gc", "--index", str(tmp_path / "idx")]).exit_code == 0
    assert sorted((tmp_path / "idx" / "kv").rglob("*.safetensors")) == files  # gc kept them
    monkeypatch.undo()
    mtimes = {p: p.stat().st_mtime_ns for p in files}
    assert runner.invoke(app, args).exit_code == 0  # resumed: the kept caches are read, not computed again
    assert all(p.stat().st_mtime_ns == t for p, t in mtimes.items())
    assert not (tmp_path / "idx" / "pending.json").exists()
    check = runner.invoke(app, ["check", "--index", str(tmp_path / "idx")])
    assert check.exit_code == 0 and "resumable" not in check.output and "garbage" not in check.output


def test_chat_reads_each_turn_before_from_the_conversation_cache(built, model_dir, tmp_path):
    """`rag-kvcache chat`: one message a line; each turn gets its new chunks, keeps the earlier ones in the
    conversation, and reads the turns before it from the conversation cache (only the new message computed)."""
    chatty = tmp_path / "chat-model"
    shutil.copytree(model_dir, chatty)
    tokenizer = AutoTokenizer.from_pretrained(chatty)
    tokenizer.chat_template = CHATML
    tokenizer.save_pretrained(chatty)
    root, _ = built
    index = tmp_path / "idx"
    result = runner.invoke(
        app, ["index", str(root / "docs"), "--index", str(index), "--chunk-tokens", "128", "--model", str(chatty)]
    )
    assert result.exit_code == 0, result.output
    result = runner.invoke(
        app,
        ["chat", "--index", str(index), "--max-new-tokens", "3", "--top-k", "1"],
        input="What is the telescope called?\n\nAnd Saltmere?\nAnd the telescope again?\n",
    )
    assert result.exit_code == 0, result.output
    text = re.sub(r"\s+", " ", result.output)  # rich wraps lines at the terminal's width
    stats = re.findall(r"(\d+) prompt tokens, (\d+) from cache \((\d+) of the conversation\), (\d+) new", text)
    assert len(stats) == 3, result.output  # the empty line is skipped
    (n1, _, conv1, new1), (n2, _, conv2, new2), (n3, cached3, conv3, new3) = [tuple(map(int, s)) for s in stats]
    assert conv1 == 0 and new1 == 1 and new2 == 1  # Saltmere's chunk joins the telescope's
    assert conv2 >= n1 and conv3 >= n2  # each turn reads the whole turn before it (and its answer)
    assert new3 == 0 and cached3 >= conv3  # the telescope's chunk is already in the chat: nothing new
