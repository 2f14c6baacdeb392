"""Fast by default: how many shards a job runs in, how its work is spread over them, repeats generated
once, and the dtype a shard computes in."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from batch_pipeline.contract import BatchCompletionsModelConfig
from batch_pipeline.shards.format import format_result, read_copies, read_work_items
from batch_pipeline.shards.merge import partial_outputs
from batch_pipeline.shards.planning import (
    GENERATION_GROUPING,
    PlanningSettings,
    RecordedPlan,
    ShardPlan,
    plan_shard_count,
    write_shards,
)
from batch_pipeline.shards.protocol import ShardTask
from batch_pipeline.shards.records import work_items
from batch_pipeline.worker.engine import choose_dtype, cpu_flags
from batch_pipeline.worker.runner import ShardRunner
from tests.conftest import MODEL


def _chat(text: str, max_tokens: int = 16, **fields) -> dict:
    return {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, **fields}


def _items(records):
    return work_items((f"content.{i}", record) for i, record in enumerate(records))


def test_a_small_job_runs_in_one_shard_whatever_it_asks_and_says_why():
    records = [_chat(f"question {i}") for i in range(20)]  # ~25 tokens each
    plan, items = plan_shard_count(
        _items(records), requested=4, settings=PlanningSettings(max_shards=None, min_tokens_per_shard=8192)
    )
    assert (plan.requested, plan.used) == (4, 1)
    assert "8192" in plan.reason and "engine" in plan.reason
    assert [item.index for item, _ in items] == list(range(20))  # nothing lost to the read-ahead


def test_a_job_is_split_no_further_than_its_work_fills_or_the_deployment_runs_at_once():
    records = [_chat(f"question {i}", max_tokens=1000) for i in range(20)]  # ~20k tokens
    plan, _ = plan_shard_count(
        _items(records), requested=8, settings=PlanningSettings(max_shards=None, min_tokens_per_shard=8192)
    )
    assert plan.used == 2
    plan, _ = plan_shard_count(
        _items(records), requested=8, settings=PlanningSettings(max_shards=None, min_tokens_per_shard=0)
    )
    assert (plan.used, plan.reason) == (8, None)
    plan, _ = plan_shard_count(
        _items(records), requested=8, settings=PlanningSettings(max_shards=3, min_tokens_per_shard=0)
    )
    assert plan.used == 3 and "at most 3 shard workers at once" in plan.reason


def test_the_deployments_shard_planning_caps_a_job_at_what_its_launcher_runs_at_once_unless_it_names_a_cap():
    from batch_pipeline.pipeline.resources import ShardPlanning

    records = [_chat(f"question {i}", max_tokens=1000) for i in range(20)]
    unset = ShardPlanning(max_shards_per_job=None, min_shard_tokens=0, deduplicate=False)
    plan, _ = plan_shard_count(_items(records), requested=8, settings=unset.for_launcher(slots=2))
    assert plan.used == 2 and "at most 2 shard workers at once" in plan.reason
    named = ShardPlanning(max_shards_per_job=5, min_shard_tokens=0, deduplicate=True)
    plan, _ = plan_shard_count(_items(records), requested=8, settings=named.for_launcher(slots=2))
    assert plan.used == 5
    assert (unset.for_launcher(2).deduplicate, named.for_launcher(None).deduplicate) == (False, True)


def test_planning_reads_ahead_only_as_far_as_it_needs():
    read = []

    def records():
        for i in range(100_000):
            read.append(i)
            yield f"content.{i}", _chat(f"question {i}", max_tokens=100)

    plan, items = plan_shard_count(
        work_items(records()), requested=2, settings=PlanningSettings(max_shards=None, min_tokens_per_shard=1000)
    )
    assert plan.used == 2
    assert len(read) < 30  # 2 shards' worth of ~100-token requests, not the whole input
    assert sum(1 for _ in items) == 100_000


def test_shards_are_balanced_by_estimated_tokens_not_by_request_count(tmp_path):
    """Long and short requests alternating: dealt out by count, every long one lands in the same shard."""
    long_text = "A long document about the history of batch inference. " * 150  # ~2,000 tokens
    records = [_chat(long_text, max_tokens=256), _chat("hi")] * 12 + [_chat(f"hi {i}") for i in range(72)]
    shards = write_shards(_items(records), 2, str(tmp_path))
    loads = sorted(shard.estimated_tokens for shard in shards)
    assert loads[1] / loads[0] < 1.2, loads
    long_ones = [
        sum(1 for item in read_work_items(shard.input_path) if len(str(item.request)) > 1000) for shard in shards
    ]
    assert long_ones == [6, 6]


def test_a_repeated_deterministic_request_is_planned_once_and_its_copies_point_at_it(tmp_path):
    greedy = _chat("What is 2 + 2?", temperature=0)
    seeded = _chat("Tell me a joke.", temperature=0.9, seed=7)
    sampled = _chat("Tell me a story.", temperature=0.9)
    records = [greedy, seeded, sampled, greedy, sampled, seeded, {**greedy, "max_tokens": 17}, greedy]
    shards = write_shards(_items(records), 2, str(tmp_path), deduplicate=True)

    copies = {}
    planned = []
    for shard in shards:
        planned += [item.index for item in read_work_items(shard.input_path)]
        for source, indices in read_copies(shard.copies_path).items():
            assert source in [item.index for item in read_work_items(shard.input_path)]  # same shard
            copies.update({index: source for index in indices})
    assert copies == {3: 0, 5: 1, 7: 0}
    assert sorted(planned) == [0, 1, 2, 4, 6]  # sampled requests and other parameters are not repeats
    assert sum(shard.item_count for shard in shards) == 8
    assert sum(shard.copy_count for shard in shards) == 3

    plain = write_shards(_items(records), 1, str(tmp_path / "plain"))
    assert plain[0].copy_count == 0 and not Path(plain[0].copies_path).exists()


def test_greedy_requests_differing_only_in_their_limit_are_planned_into_one_shard(tmp_path):
    """So that one engine answers them with one generation; the rest is still balanced. A job planned
    before this grouping existed is written as it was planned, so its checkpoints still line up."""
    summary = [_chat("Summarise the history of Rome.", max_tokens=limit, temperature=0) for limit in (8, 32, 96)]
    others = [_chat(f"Question {i}?", temperature=0) for i in range(30)]
    records = [summary[0], *others[:10], summary[1], *others[10:20], summary[2], *others[20:]]

    def shards_holding_the_summaries(group_generations: bool, directory: str) -> list[int]:
        shards = write_shards(_items(records), 3, str(tmp_path / directory), True, group_generations)
        return [
            shard.shard_index
            for shard in shards
            for item in read_work_items(shard.input_path)
            if "Rome" in json.dumps(item.request)
        ]

    assert len(set(shards_holding_the_summaries(True, "grouped"))) == 1
    assert len(set(shards_holding_the_summaries(False, "balanced"))) > 1  # balanced by load alone

    earlier = '{"requested": 3, "used": 3, "reason": null, "deduplicate": true}'
    assert RecordedPlan.from_json(earlier).group_generations is False
    now = RecordedPlan(ShardPlan(requested=3, used=3), deduplicate=True, generation_grouping=GENERATION_GROUPING)
    assert RecordedPlan.from_json(now.to_json()) == now and now.group_generations
    later = RecordedPlan(ShardPlan(requested=3, used=3), deduplicate=True, generation_grouping=GENERATION_GROUPING + 1)
    with pytest.raises(ValueError, match="planned by a later release"):
        RecordedPlan.from_json(later.to_json()).group_generations


def test_a_group_weighs_what_its_largest_limit_generates_so_shards_stay_balanced(tmp_path):
    """Found by review: a group weighed only its first request, and drew its later ones wherever it was. A
    sweep asking every prompt short first and long later put all the long generations in one shard while
    the planner saw two equal ones."""
    prompts = [f"Prompt {i}" for i in range(300)]
    records = [_chat("A long story.", max_tokens=4096, temperature=0)]
    records += [_chat(p, max_tokens=8, temperature=0) for p in prompts]
    records += [_chat(p, max_tokens=4096, temperature=0) for p in prompts]
    shards = write_shards(_items(records), 2, str(tmp_path), True, True)

    generated = []  # what each shard's engine generates: each group once, at its largest limit
    for shard in shards:
        largest: dict[str, int] = {}
        for item in read_work_items(shard.input_path):
            text = item.request["messages"][0]["content"]
            largest[text] = max(largest.get(text, 0), item.request["max_tokens"])
        generated.append(sum(largest.values()))
    assert max(generated) / min(generated) < 1.1, generated
    estimated = [shard.estimated_tokens for shard in shards]
    assert max(estimated) / min(estimated) < 1.1, estimated


def test_requests_further_apart_than_the_workers_window_are_planned_as_the_load_says(tmp_path, monkeypatch):
    """The worker shares a generation only within its window of a shard's items: a request farther from its
    group than that is generated on its own, and weighs so."""
    from batch_pipeline.shards import planning

    monkeypatch.setattr(planning, "WORKER_WINDOW", 4)
    summary = [_chat("Summarise Rome.", max_tokens=limit, temperature=0) for limit in (8, 16)]

    def total_tokens(between: int) -> int:
        records = [summary[0], *(_chat(f"Q{i}?") for i in range(between)), summary[1]]
        (shard,) = write_shards(_items(records), 1, str(tmp_path / str(between)), True, True)
        return shard.estimated_tokens

    one_apart, far_apart = total_tokens(2), total_tokens(6)
    sizes = [size.tokens for _, size in _items([summary[1], *(_chat(f"Q{i}?") for i in range(4))])]
    assert far_apart - one_apart == sum(sizes[1:]) + sizes[0] - 8  # the 4 more requests, and the whole second


def test_a_worker_restarted_after_writing_a_source_fills_its_copies_without_an_engine(tmp_path):
    """The worker was stopped between a source's output and its copies' (or the source finished and only
    the copies are owed): the restarted worker answers them from the checkpoint and starts no engine."""
    records = [_chat("What is 2 + 2?", temperature=0), _chat("Name a colour.", temperature=0)] * 2
    (shard,) = write_shards(_items(records), 1, str(tmp_path), deduplicate=True)
    outputs = {
        index: {
            "id": f"chatcmpl-{index}",
            "object": "chat.completion",
            "choices": [{"text": f"answer {index}"}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 2},
        }
        for index in (0, 1)
    }
    Path(shard.results_path).write_text(
        format_result(0, outputs[0])
        + format_result(1, outputs[1])
        + format_result(2, {**outputs[0], "id": "chatcmpl-2"})
    )
    task = ShardTask(shard=shard, model_config={"model": "no-such-model"})

    stats = ShardRunner(task, checkpoint_upload_s=60).run()

    merged = [json.loads(line.split("\t", 1)[1]) for line in Path(shard.output_path).read_text().splitlines()]
    assert [output["choices"] for output in merged] == [outputs[0]["choices"], outputs[1]["choices"]] * 2
    assert [output["id"] for output in merged] == [f"chatcmpl-{i}" for i in range(4)]
    assert (stats.deduplicated, stats.engine_start_s, stats.completion_tokens) == (2, 0.0, 8)


def test_a_stopped_jobs_partial_output_lists_copies_in_their_place(tmp_path):
    records = [_chat("What is 2 + 2?", temperature=0), _chat("Name a colour.", temperature=0)] * 2
    (shard,) = write_shards(_items(records), 1, str(tmp_path), deduplicate=True)
    Path(shard.results_path).write_text(format_result(0, {"text": "4"}) + format_result(2, {"text": "4"}))
    assert list(partial_outputs(str(tmp_path), lambda index: f"missing {index}")) == [
        (0, '{"text": "4"}'),
        (1, "missing 1"),
        (2, '{"text": "4"}'),
        (3, "missing 3"),
    ]


@pytest.mark.parametrize(
    ("flags", "named", "expected"),
    [
        ({"avx2", "avx512f"}, None, "float32"),  # an AMD EPYC without AVX-512 BF16: bf16 through slow fallbacks
        ({"avx512f", "avx512_bf16"}, None, None),  # the model's own
        ({"amx_bf16"}, None, None),
        ({"asimd", "bf16"}, None, None),  # Arm with FEAT_BF16
        ({"avx2"}, "bfloat16", "bfloat16"),  # a named dtype is kept, fast or not
        ({"avx2"}, "auto", "auto"),
    ],
)
def test_the_dtype_is_the_requests_else_the_models_except_where_the_cpu_lacks_bfloat16(flags, named, expected):
    config = BatchCompletionsModelConfig(model=MODEL, dtype=named)
    dtype, reason = choose_dtype(config, on_cpu=True, flags=flags)
    assert dtype == expected
    assert reason


def test_quantized_weights_and_accelerators_keep_the_models_dtype():
    assert choose_dtype(BatchCompletionsModelConfig(model=MODEL), on_cpu=False, flags=set())[0] is None
    quantized = BatchCompletionsModelConfig(model=MODEL, quantization="awq")
    assert choose_dtype(quantized, on_cpu=True, flags=set())[0] is None


def test_cpu_flags_are_read_from_cpuinfo(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse avx2 avx512f\n\n")
    assert cpu_flags(str(cpuinfo)) == {"fpu", "sse", "avx2", "avx512f"}
    assert cpu_flags(str(tmp_path / "absent")) == set()


@pytest.mark.slow
def test_a_default_small_job_runs_one_engine_in_the_fast_dtype_and_answers_repeats_once(run_job, tmp_path, monkeypatch):
    """A default request as a user sends it: two shards asked, greedy questions asked twice, no dtype."""
    monkeypatch.delenv("BATCH_PIPELINE_MIN_SHARD_TOKENS")
    questions = ["What is the capital of France?", "Name a primary colour.", "What is 3 times 4?"]
    requests = [_chat(q, max_tokens=12, temperature=0) for q in questions] * 2 + [_chat(questions[0], max_tokens=12)]
    output = tmp_path / "output.json"

    result = run_job(
        {"output_data_path": str(output), "model_config": {"model": MODEL}, "data_parallelism": 2, "content": requests}
    )

    assert result.success
    outputs = json.loads(output.read_text())
    texts = [o["choices"][0]["message"]["content"] for o in outputs]
    assert texts[:3] == texts[3:6] and all(texts[:3])
    assert len({o["id"] for o in outputs}) == 7
    assert [o["usage"] for o in outputs[:3]] == [o["usage"] for o in outputs[3:6]]
    metadata = json.loads(Path(str(output) + ".metadata.json").read_text())
    assert metadata["data_parallelism"]["requested"] == 2 and metadata["data_parallelism"]["used"] == 1
    assert "engine" in metadata["data_parallelism"]["reason"]
    assert metadata["num_deduplicated"] == 3
    (shard,) = metadata["shards"]
    assert shard["deduplicated"] == 3
    native_bf16 = bool(cpu_flags() & {"avx512_bf16", "amx_bf16", "bf16"})
    assert metadata["dtype"] == shard["dtype"] == ("bfloat16" if native_bf16 else "float32")
    assert shard["dtype_reason"]

    named = tmp_path / "named.json"
    result = run_job(
        {"output_data_path": str(named), "model_config": {"model": MODEL, "dtype": "float32"}, "content": requests[:1]}
    )
    assert result.success
    metadata = json.loads(Path(str(named) + ".metadata.json").read_text())
    assert metadata["dtype"] == "float32" and metadata["shards"][0]["dtype_reason"] == "named by the request"


def test_a_shard_task_of_another_shape_fails_where_it_is_read_naming_the_field(tmp_path):
    (shard,) = write_shards(_items([_chat("question")]), 1, str(tmp_path / "job"))
    task = ShardTask(shard=shard, model_config={"model": MODEL}, job_id="batch-1")
    assert ShardTask.from_dict(json.loads(json.dumps(task.to_dict()))) == task  # as Pipes carries it
    renamed = task.to_dict()
    renamed["shard"]["items"] = renamed["shard"].pop("item_count")
    with pytest.raises(ValueError, match=r"shard\.item_count: Field required"):
        ShardTask.from_dict(renamed)
    with pytest.raises(ValueError, match=r"shard_count: Input should be a valid integer"):
        ShardTask.from_dict({**task.to_dict(), "shard_count": "two"})


@pytest.mark.slow
def test_a_worker_keeps_its_engine_until_it_exits(tmp_path):
    """A dropped in-process engine shuts down: it unfreezes the objects vLLM froze out of garbage
    collection and collects the whole heap twice (~1.4 s on 2 cores), between the shard's last result and
    the worker's exit, which its step waits for. The worker's entry point, as the standby worker runs it:
    vLLM imported first (where the engine is built, something vLLM keeps from its own imports held the
    builder's frame, and with it the engine, alive, hiding the cost)."""
    (shard,) = write_shards(
        work_items([("content", {"prompts": ["Name a colour."], "max_new_tokens": 4, "temperature": 0.0})]),
        1,
        str(tmp_path / "job"),
    )
    (tmp_path / "task.json").write_text(json.dumps(ShardTask(shard=shard, model_config={"model": MODEL}).to_dict()))
    script = (
        "import gc, json, sys\nfrom batch_pipeline.worker import __main__ as worker\n"
        "worker.set_engine_environment()\nworker._import_engine()\n"
        f"worker.main(['--task', {str(tmp_path / 'task.json')!r}])\n"
        "print(json.dumps({'frozen': gc.get_freeze_count()}), file=sys.stderr)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, check=False)

    assert done.returncode == 0, done.stderr[-3000:]
    stats = json.loads(done.stdout.strip().splitlines()[-1])
    assert stats["generated"] == 1 and stats["engine_start_s"] > 0
    frozen = json.loads(done.stderr.strip().splitlines()[-1])["frozen"]
    assert frozen > 100_000, "the engine was shut down before the worker exited"
