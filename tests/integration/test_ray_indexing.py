"""Indexing on Ray (`RayWorkers`): on a local Ray cluster started here, with the tiny random-weight
model saved to a folder the actors load it from. A Ray-built index equals a locally built one (same
chunk ids, same caches bit for bit, same answers); a job interrupted mid-way, run again, reuses the
caches its workers stored and commits the index once; workers whose caches the driver cannot see, or
that load other weights, make the job fail with nothing committed."""

from __future__ import annotations

import pytest
import torch
from test_precompute_batching import docs  # noqa: F401 (the documents folder fixture)
from tiny_model import tiny_llama
from typer.testing import CliRunner

ray = pytest.importorskip("ray")

from rag_kvcache.cli import app  # noqa: E402
from rag_kvcache.config import Config, FusionConfig, GenerationConfig, IndexSettings, QueryConfig, RuntimeConfig  # noqa: E402
from rag_kvcache.engine.model import ModelAdapter  # noqa: E402
from rag_kvcache.index import KVIndex  # noqa: E402
from rag_kvcache.indexing import cluster  # noqa: E402
from rag_kvcache.query.generator import FusedGenerator  # noqa: E402


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def config(tmp_path_factory, tokenizer) -> Config:
    """The tiny Llama as a model folder, which the driver and every actor load (`ModelAdapter.load`)."""
    folder = tmp_path_factory.mktemp("tiny-model")
    tiny_llama().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return Config(
        index=IndexSettings(model=str(folder), chunk_tokens=24),
        query=QueryConfig(top_k=3, generation=GenerationConfig(max_new_tokens=6)),
        runtime=RuntimeConfig(ray_workers=2),
    )


@pytest.fixture()
def one_thread():
    """Torch on one thread, as in each actor (Ray gives it one CPU): BLAS may pick other kernels for
    another thread count on tiny shapes (a 3-token chunk's cache differed by 7e-8 at 2 threads)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def own_key(index: KVIndex, ids: tuple[int, ...]) -> str:
    """The key of a chunk's own cache (behind the prefix, or behind the chunks before it in its group)."""
    return index.addressing.key(ids, index.addressing.own_context(ids))


@pytest.mark.parametrize("prefill", ["grouped", "behind_prefix"])
def test_index_built_on_ray_by_the_cli_equals_local_one(local_ray, config, docs, tmp_path, one_thread, prefill):
    config = config.with_index(chunk_prefill=prefill)
    local = KVIndex.build(docs, tmp_path / "local", config, progress=False)
    result = CliRunner().invoke(
        app,
        [
            "index",
            str(docs),
            "--index",
            str(tmp_path / "ray"),
            "--model",
            config.index.model,
            "--chunk-tokens",
            "24",
            "--ray",
            "local",
            "--ray-workers",
            "2",
            "--chunk-prefill",
            prefill,
        ],
    )
    assert result.exit_code == 0, result.output
    on_ray = KVIndex.open(tmp_path / "ray", config)
    chunks = sorted(local.chunks.all_chunks(), key=lambda c: c.id)
    assert [c.id for c in chunks] == sorted(c.id for c in on_ray.chunks.all_chunks())
    assert (
        len({len(c.token_ids) for c in chunks}) > 1 and len(chunks) > 8
    )  # several packs (4 chunks each at most) for two actors
    for chunk in chunks:
        want, got = (
            local.store.get(own_key(local, chunk.token_ids)),
            on_ray.store.get(own_key(on_ray, chunk.token_ids)),
        )
        assert got.position == want.position
        assert all(torch.equal(g, w) for g, w in zip(got.keys + got.values, want.keys + want.values))
    question = "Which crates left the harbour at dawn?"
    answers = [
        FusedGenerator(index).ask(question, fusion=FusionConfig(method="cacheblend")) for index in (local, on_ray)
    ]
    assert answers[0].answer == answers[1].answer and answers[1].cache_misses == 0
    assert [c.id for c in answers[0].chunks] == [c.id for c in answers[1].chunks]


class _InterruptedBar:
    """A progress bar whose first update is a Ctrl-C: the job stops after its first pack came back."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def update(self, n: int) -> None:
        raise KeyboardInterrupt


def test_interrupted_job_resumes_reusing_stored_caches(local_ray, config, docs, tmp_path, monkeypatch):
    index = KVIndex.create(tmp_path / "idx", config)
    with monkeypatch.context() as patch:
        patch.setattr(cluster, "tqdm", _InterruptedBar)
        with pytest.raises(KeyboardInterrupt), index.ray_workers() as workers:
            index.update(docs, progress=False, workers=workers)
    n_chunks = len(index.chunks)
    assert n_chunks > 0  # committed before any cache was made: searchable
    stored = {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in index.store.disk.files()}
    prefix = index.addressing.key(index.format.prefix_ids, ())
    assert len([p for p in stored if p.stem != prefix]) >= 1  # the first pack's caches (the driver stores the prefix's)

    with index.ray_workers() as workers:
        report = index.update(docs, progress=False, workers=workers)
    chunks = list(index.chunks.all_chunks())
    assert report.new_chunks == [] and len(chunks) == n_chunks > len(stored) - 1  # the rest computed by the re-run
    assert all(own_key(index, c.token_ids) in index.store for c in chunks)
    assert {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in stored} == stored  # reused, not rewritten


def test_workers_whose_caches_the_driver_cannot_see_or_of_another_model_are_refused(
    local_ray, config, docs, tmp_path, tokenizer
):
    """Fault injection: actors writing a store the driver does not read (another index's folder, as
    on machines without a shared tier), and actors loading other weights than the driver's."""
    index = KVIndex.create(tmp_path / "idx", config.with_runtime(ray_workers=1))
    elsewhere = KVIndex.create(tmp_path / "elsewhere", config.with_runtime(ray_workers=1), adapter=index.adapter)
    with elsewhere.ray_workers() as workers, pytest.raises(RuntimeError, match="are not in the store .*--kv-remote"):
        index.update(docs, progress=False, workers=workers)
    assert not any(own_key(index, c.token_ids) in index.store for c in index.chunks.all_chunks())  # none served

    other = KVIndex.create(
        tmp_path / "other",
        config.with_runtime(ray_workers=1),
        adapter=ModelAdapter(tiny_llama(seed=7), tokenizer, name="other"),
    )
    with other.ray_workers() as workers, pytest.raises(ray.exceptions.RayActorError, match="not the driver's"):
        other.update(docs, progress=False, workers=workers)
    assert not any(own_key(other, c.token_ids) in other.store for c in other.chunks.all_chunks())
