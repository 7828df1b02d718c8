"""The launcher's flags: TGI's names, defaults and environment variables, the
aliases users copy from guides, one-line errors with exit 2, and TGI 3's
derivation of the token limits (resolve_limits)."""

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from tgi_router.launch import launcher
from tgi_router.launch.config import ConfigError, RouterConfig, parse_args
from tgi_router.launch.limits import Limits, prefill_tokens, resolve_limits

# TGI 3 launcher/src/main.rs `Args` defaults (flags of the issue).
TGI_DEFAULTS = dict(
    revision=None, dtype=None, sharded=None, num_shard=1, quantize=None, trust_remote_code=False,
    max_concurrent_requests=128, max_best_of=2, max_stop_sequences=4, max_top_n_tokens=5,
    max_input_tokens=None, max_total_tokens=None, waiting_served_ratio=0.3,
    max_batch_prefill_tokens=None, max_batch_total_tokens=None, max_waiting_tokens=20,
    max_batch_size=None, hostname="0.0.0.0", port=3000, shard_uds_path="/tmp/text-generation-server",
    master_addr="localhost", master_port=29500, huggingface_hub_cache=None, json_output=False,
    cors_allow_origin=(), api_key=None, payload_limit=2_000_000, tokenizer_config_path=None,
    graceful_termination_timeout=90, flash_attention=False)

# (flag argv, env name, env value, attribute, expected value)
FLAGS = [
    (["--model-id", "org/m"], "MODEL_ID", "org/m", "model_id", "org/m"),
    (["--revision", "refs/pr/2"], "REVISION", "refs/pr/2", "revision", "refs/pr/2"),
    (["--dtype", "bfloat16"], "DTYPE", "bfloat16", "dtype", "bfloat16"),
    (["--sharded", "false"], "SHARDED", "false", "sharded", False),
    (["--num-shard", "1"], "NUM_SHARD", "1", "num_shard", 1),
    (["--trust-remote-code"], "TRUST_REMOTE_CODE", "true", "trust_remote_code", True),
    (["--max-concurrent-requests", "7"], "MAX_CONCURRENT_REQUESTS", "7", "max_concurrent_requests", 7),
    (["--max-best-of", "3"], "MAX_BEST_OF", "3", "max_best_of", 3),
    (["--max-stop-sequences", "6"], "MAX_STOP_SEQUENCES", "6", "max_stop_sequences", 6),
    (["--max-top-n-tokens", "9"], "MAX_TOP_N_TOKENS", "9", "max_top_n_tokens", 9),
    (["--max-input-tokens", "100"], "MAX_INPUT_TOKENS", "100", "max_input_tokens", 100),
    (["--max-input-length", "100"], "MAX_INPUT_LENGTH", "100", "max_input_tokens", 100),
    (["--max-total-tokens", "200"], "MAX_TOTAL_TOKENS", "200", "max_total_tokens", 200),
    (["--waiting-served-ratio", "1.2"], "WAITING_SERVED_RATIO", "1.2", "waiting_served_ratio", 1.2),
    (["--max-batch-prefill-tokens", "512"], "MAX_BATCH_PREFILL_TOKENS", "512", "max_batch_prefill_tokens", 512),
    (["--max-batch-total-tokens", "9000"], "MAX_BATCH_TOTAL_TOKENS", "9000", "max_batch_total_tokens", 9000),
    (["--max-waiting-tokens", "5"], "MAX_WAITING_TOKENS", "5", "max_waiting_tokens", 5),
    (["--max-batch-size", "32"], "MAX_BATCH_SIZE", "32", "max_batch_size", 32),
    (["--hostname", "127.0.0.1"], "HOSTNAME", "127.0.0.1", "hostname", "127.0.0.1"),
    (["--port", "8080"], "PORT", "8080", "port", 8080),
    (["--shard-uds-path", "/tmp/x"], "SHARD_UDS_PATH", "/tmp/x", "shard_uds_path", "/tmp/x"),
    (["--master-addr", "10.0.0.1"], "MASTER_ADDR", "10.0.0.1", "master_addr", "10.0.0.1"),
    (["--master-port", "29501"], "MASTER_PORT", "29501", "master_port", 29501),
    (["--huggingface-hub-cache", "/data"], "HUGGINGFACE_HUB_CACHE", "/data", "huggingface_hub_cache", "/data"),
    (["--json-output"], "JSON_OUTPUT", "true", "json_output", True),
    (["--cors-allow-origin", "http://a"], "CORS_ALLOW_ORIGIN", "http://a", "cors_allow_origin", ("http://a",)),
    (["--api-key", "secret"], "API_KEY", "secret", "api_key", "secret"),
    (["--payload-limit", "1000"], "PAYLOAD_LIMIT", "1000", "payload_limit", 1000),
    (["--tokenizer-config-path", "/t.json"], "TOKENIZER_CONFIG_PATH", "/t.json", "tokenizer_config_path", "/t.json"),
    (["--graceful-termination-timeout", "3"], "GRACEFUL_TERMINATION_TIMEOUT", "3", "graceful_termination_timeout", 3),
    (["--flash-attention"], "FLASH_ATTENTION", "true", "flash_attention", True),
    (["--kv-cache-bytes", "2GiB"], "KV_CACHE_BYTES", "2GiB", "kv_cache_bytes", 2 << 30),
    (["--num-threads", "2"], "NUM_THREADS", "2", "num_threads", 2),
    (["--disable-playground"], "DISABLE_PLAYGROUND", "true", "disable_playground", True),
]


def test_defaults_are_tgis():
    config = parse_args([], {})
    assert {k: getattr(config, k) for k in TGI_DEFAULTS} == TGI_DEFAULTS
    assert config.model_id is None  # ours: the shard's default model, SmolLM2-135M-Instruct


@pytest.mark.parametrize("argv,env_name,env_value,attr,expected", FLAGS, ids=[f[1] for f in FLAGS])
def test_each_flag_and_its_environment_variable(argv, env_name, env_value, attr, expected):
    assert getattr(parse_args(argv, {}), attr) == expected
    assert getattr(parse_args([], {env_name: env_value}), attr) == expected


def test_flags_win_over_environment():
    config = parse_args(["--port", "8080", "--model-id", "flag/m"], {"PORT": "9000", "MODEL_ID": "env/m"})
    assert (config.port, config.model_id) == (8080, "flag/m")


def test_aliases_users_copy_from_guides():
    config = parse_args(["--model", "org/m", "-p", "8080", "--max-input-length", "10"], {})
    assert (config.model_id, config.port, config.max_input_tokens) == ("org/m", 8080, 10)


def test_empty_environment_variable_counts_as_unset():
    assert parse_args([], {"PORT": "", "MODEL_ID": ""}).port == 3000


@pytest.mark.parametrize("raw,expected", [("true", True), ("1", True), ("false", False), ("0", False)])
def test_boolean_environment_values(raw, expected):
    assert parse_args([], {"JSON_OUTPUT": raw}).json_output is expected


def test_cors_allow_origin_repeats():
    argv = ["--cors-allow-origin", "http://a", "--cors-allow-origin", "http://b"]
    assert parse_args(argv, {}).cors_allow_origin == ("http://a", "http://b")


def test_other_tgi_flags_are_accepted_and_recorded_as_ignored():
    argv = ["--usage-stats", "off", "--disable-custom-kernels", "-e"]
    config = parse_args(argv, {"VALIDATION_WORKERS": "4"})
    assert set(config.ignored_flags) == {"--usage-stats", "--disable-custom-kernels",
                                         "--env", "--validation-workers"}


def test_a_speculative_model_drafts_4_unless_told_and_reaches_the_shards():
    from tgi_router.launch.shard_processes import shard_command
    config = parse_args(["--speculative-model", "/models/draft"], {})
    assert (config.speculative_model, config.speculate) == ("/models/draft", 4)
    assert parse_args(["--speculative-model", "d", "--speculate", "2"], {}).speculate == 2
    command = shard_command(config, 0)
    assert command[command.index("--speculative-model") + 1] == "/models/draft"
    assert "--speculative-model" not in shard_command(parse_args([], {}), 0)
    with pytest.raises(ConfigError, match="speculate"):
        parse_args(["--speculative-model", "d"], {"SPECULATE": "0"})


def test_speculate_is_a_count_up_to_the_limit():
    assert parse_args(["--speculate", "3"], {}).speculate == 3
    assert parse_args([], {"SPECULATE": "6"}).speculate == 6
    assert parse_args([], {}).speculate is None  # TGI's default: the Medusa heads, if the model has any
    assert parse_args(["--speculate", "0"], {}).speculate == 0
    with pytest.raises(ConfigError):
        parse_args(["--speculate", "33"], {})
    with pytest.raises(ConfigError):
        parse_args(["--speculate", "-1"], {})


def test_log_level_comes_from_tgis_variable():
    assert parse_args([], {"LOG_LEVEL": "debug"}).log_level == "debug"
    assert parse_args([], {"LOG_LEVEL": "text_generation_launcher=warn"}).log_level == "warning"
    assert parse_args([], {"LOG_LEVEL": "nonsense"}).log_level == "info"


@pytest.mark.parametrize("args, env, shards", [
    ([], {"CUDA_VISIBLE_DEVICES": "0,1"}, 2),    # TGI: every visible device
    ([], {}, 1),
    (["--sharded", "false"], {"CUDA_VISIBLE_DEVICES": "0,1"}, 1),
    (["--sharded", "false", "--num-shard", "3"], {}, 3),
    (["--sharded", "true"], {"CUDA_VISIBLE_DEVICES": "0,1,2"}, 3),
    (["--num-shard", "2"], {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}, 2),
])
def test_number_of_shards_as_tgi_finds_it(args, env, shards):
    assert parse_args(args, env).num_shard == shards


def test_prefill_budget_below_max_input_is_accepted_as_tgi_3_does_with_chunking():
    config = parse_args(["--max-input-tokens", "8000", "--max-batch-prefill-tokens", "4096"], {})
    assert (config.max_input_tokens, config.max_batch_prefill_tokens) == (8000, 4096)


INVALID = [
    (["--port", "x"], {}, "argument --port/-p: invalid value 'x'"),
    (["--port", "70000"], {}, "invalid value '70000'"),
    (["--max-total-tokens", "-1"], {}, "invalid value '-1'"),
    (["--dtype", "int8"], {}, "possible values: float16, bfloat16, float32"),
    (["--quantize", "q9"], {}, "possible values: awq"),
    (["--quantize", "fp8"], {}, "--quantize fp8 is not supported (supported: awq, eetq, gptq)"),
    ([], {"QUANTIZE": "marlin"}, "--quantize marlin is not supported"),
    (["--num-shard", "0"], {}, "`num_shard` cannot be < 1"),
    (["--sharded", "true"], {},
     "--num-shard and CUDA_VISIBLE_DEVICES/NVIDIA_VISIBLE_DEVICES/ZE_AFFINITY_MASK are not set"),
    (["--sharded", "true"], {"CUDA_VISIBLE_DEVICES": "0"}, "`sharded` is true but only found 1 CUDA devices"),
    (["--sharded", "true", "--num-shard", "1"], {}, "`sharded` is true but `num_shard` <= 1"),
    (["--sharded", "maybe"], {}, "expected true or false"),
    (["--max-input-tokens", "5", "--max-total-tokens", "5"], {},
     "`max_input_tokens`(5) must be < `max_total_tokens`(5)"),
    (["--max-input-tokens", "1", "--max-input-length", "2"], {},
     "Both `max_input_tokens` (1) and `max_input_length` (2) are set"),
    (["--max-total-tokens", "9000", "--max-batch-total-tokens", "8000"], {},
     "`max_total_tokens` must be <= `max_batch_total_tokens`. Given: 9000 and 8000"),
    (["--max-batch-prefill-tokens", "9000", "--max-batch-total-tokens", "8000"], {},
     "`max_batch_prefill_tokens` must be <= `max_batch_total_tokens`. Given: 9000 and 8000"),
    (["--waiting-served-ratio", "-0.5"], {}, "`waiting_served_ratio` must be >= 0"),
    (["--waiting-served-ratio", "nan"], {}, "expected a finite number"),
    (["--max-batch-size", "0"], {}, "`max_batch_size` must be > 0"),
    (["--kv-cache-bytes", "lots"], {}, "expected a size such as 4096, 512MiB or 2GiB"),
    (["--rope-scaling", "ntk"], {}, "possible values: linear, dynamic, yarn"),
    (["--rope-factor", "0"], {}, "`rope_factor` must be > 0. Given: 0.0"),
    (["--watermark-gamma", "1"], {}, "`watermark_gamma` must be in (0, 1). Given: 1.0"),
    (["--cuda-memory-fraction", "1.5"], {}, "`cuda_memory_fraction` must be in (0, 1]. Given: 1.5"),
    (["--kv-cache-dtype", "fp8"], {}, "possible values: fp8_e4m3fn, fp8_e5m2"),
    (["--ngrok"], {}, "--ngrok is not supported yet"),
    (["--no-such-flag"], {}, "unrecognized arguments: --no-such-flag"),
    (["--port"], {}, "expected one argument"),
    ([], {"MAX_INPUT_TOKENS": "abc"}, "invalid value 'abc' for MAX_INPUT_TOKENS"),
    ([], {"JSON_OUTPUT": "maybe"}, "invalid value 'maybe' for JSON_OUTPUT"),
]


@pytest.mark.parametrize("argv,env,message", INVALID, ids=[" ".join(a) or str(e) for a, e, _ in INVALID])
def test_bad_value_or_combination_is_one_line_and_exit_2(argv, env, message, capsys):
    with pytest.raises(SystemExit) as exited:
        launcher.main(argv, env)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err


def test_installed_command_exits_2_with_one_line():
    script = Path(sys.executable).parent / "text-generation-launcher"
    done = subprocess.run([str(script), "--max-input-tokens", "9", "--max-total-tokens", "5"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr == "error: `max_input_tokens`(9) must be < `max_total_tokens`(5)\n"


# -- resolve_limits -----------------------------------------------------------

def limits(argv=(), mpe=8192, supported=100_000) -> Limits:
    return resolve_limits(parse_args(list(argv), {}), mpe, supported)


def test_defaults_follow_the_model_and_the_kv_cache():
    assert limits() == Limits(max_input_tokens=8191, max_total_tokens=8192,
                              max_batch_prefill_tokens=4096, max_batch_total_tokens=100_000)


def test_small_kv_cache_bounds_total_tokens_and_clips_the_default_prefill():
    assert limits(supported=3000) == Limits(2999, 3000, 3000, 3000)


def test_short_model_bounds_the_default_prefill():
    assert limits(mpe=2048) == Limits(2047, 2048, 2048, 100_000)


def test_given_limits_are_kept():
    argv = ["--max-input-tokens", "100", "--max-total-tokens", "200", "--max-batch-prefill-tokens", "300"]
    assert limits(argv) == Limits(100, 200, 300, 100_000)


def test_max_input_tokens_alone_derives_the_total():
    assert limits(["--max-input-tokens", "1000"]) == Limits(1000, 8192, 4096, 100_000)


def test_smaller_max_batch_total_tokens_caps_the_cache():
    assert limits(["--max-batch-total-tokens", "5000"]) == Limits(4999, 5000, 4096, 5000)


def test_shard_without_cache_size_falls_back_as_tgi():
    assert limits(supported=0) == Limits(8191, 8192, 4096, 16000)
    assert limits(["--max-total-tokens", "20000"], supported=0).max_batch_total_tokens == 20000


def test_unknown_model_length_uses_the_cache():
    assert limits(mpe=0, supported=5000) == Limits(4999, 5000, 4096, 5000)


def test_prefill_budget_before_warmup():
    assert prefill_tokens(RouterConfig(), 8192) == 4096
    assert prefill_tokens(RouterConfig(), 512) == 512
    assert prefill_tokens(RouterConfig(max_batch_prefill_tokens=100), 8192) == 100


@pytest.mark.parametrize("argv,mpe,supported,message", [
    (["--max-total-tokens", "9000"], 16384, 4000, "Not enough memory to handle `max_total_tokens=9000`"),
    (["--max-input-tokens", "8192"], 8192, 100_000, "`max_input_tokens`(8192) must be < `max_total_tokens`(8192)"),
    (["--max-batch-prefill-tokens", "5000"], 8192, 4000,
     "`max_batch_prefill_tokens` must be <= `max_batch_total_tokens`. Given: 5000 and 4000"),
])
def test_resolved_limits_are_checked_with_tgis_messages(argv, mpe, supported, message):
    with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(").replace(")", r"\)") + "$"):
        limits(argv, mpe, supported)


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        parse_args([], {}).port = 1


@pytest.mark.parametrize("env, on", [({}, True), ({"PREFIX_CACHING": "1"}, True), ({"PREFIX_CACHING": "true"}, True),
                                     ({"PREFIX_CACHING": "0"}, False), ({"PREFIX_CACHING": "False"}, False)])
def test_prefix_caching_is_on_unless_the_environment_turns_it_off(env, on):
    assert parse_args([], env).prefix_caching is on


def test_max_stall_ratio_is_off_by_default_and_must_exceed_one():
    assert parse_args([], {}).max_stall_ratio == 0.0
    assert parse_args(["--max-stall-ratio", "2.5"], {}).max_stall_ratio == 2.5
    assert parse_args([], {"MAX_STALL_RATIO": "3"}).max_stall_ratio == 3.0
    with pytest.raises(ConfigError, match="max_stall_ratio"):
        parse_args(["--max-stall-ratio", "1"], {})
