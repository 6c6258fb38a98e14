"""Loaders of public traces (kvbench.traces.loaders): real files from ../shared/traces, hand-made bad ones.

Facts about the real files come from shared/traces/README.md and the SOURCE.md files next to them.
"""
from __future__ import annotations

import ast
import csv
import json
import math
import os
from pathlib import Path

import numpy as np
import pytest

from kvbench.traces.format import TraceError
from kvbench.traces.loaders import (
    Request,
    load_azure,
    load_lengths,
    load_mooncake,
    load_requests,
    load_servegen,
    load_vidur,
    prefix_hit_rate_unbounded,
    rehash_requests,
    split_block_hashes,
)

TRACES = Path(os.environ.get("KVBENCH_TRACES") or Path(__file__).resolve().parents[3] / "shared" / "traces")
AZURE = "azure-llm-2023/AzureLLMInferenceTrace_conv.csv"
VIDUR = "vidur-processed/splitwise_conv.csv"
ARXIV = "vidur-processed/arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv"
SHAREGPT = "sharegpt-stats/sharegpt_8k_filtered_stats_llama2_tokenizer.csv"
MOONCAKE = "mooncake/synthetic_trace.jsonl"
SERVEGEN = "servegen-sample"
DEEPSEEK = "reason__deepseek-r1__chunk-0"
LANGUAGE = "language__m-large__chunk-0"


def public(rel: str) -> Path:
    path = TRACES / rel
    if not path.exists():
        pytest.skip(f"public trace {path} is absent (data, not in the repo; "
                    "set KVBENCH_TRACES to its folder)")
    return path


def column(requests, field: str) -> np.ndarray:
    return np.array([getattr(r, field) for r in requests])


@pytest.fixture(scope="module")
def azure():
    return load_requests(public(AZURE), "azure")


@pytest.fixture(scope="module")
def mooncake():
    return load_requests(public(MOONCAKE), "mooncake")


@pytest.fixture(scope="module")
def servegen_6h():
    return load_requests(public(SERVEGEN), "servegen", seed=0, duration=6 * 3600)


# --- Azure and vidur -----------------------------------------------------------------------------

def test_azure_conv_lengths_match_the_readme(azure):
    prompt, output = column(azure, "prompt_tokens"), column(azure, "output_tokens")
    assert len(azure) == 19_366
    assert round(prompt.mean(), 1) == 1154.7 and np.median(prompt) == 1020 and prompt.max() == 14_050
    assert round(output.mean(), 1) == 211.1 and np.median(output) == 129 and output.max() == 1000


def test_azure_conv_reads_the_last_line_without_newline(azure):
    raw = public(AZURE).read_bytes()
    assert not raw.endswith(b"\n")
    _, context, generated = raw.decode().splitlines()[-1].split(",")
    assert (azure[-1].prompt_tokens, azure[-1].output_tokens) == (int(context), int(generated))


def test_azure_conv_arrivals_are_seconds_since_the_first_request(azure):
    arrival = column(azure, "arrival")
    assert arrival[0] == 0.0 and (np.diff(arrival) >= 0).all()
    # Lines 2 and 3: 18:15:46.6805900 and 18:15:50.9951690.
    assert arrival[1] == pytest.approx(50.9951690 - 46.6805900, abs=1e-9)
    assert {r.tenant for r in azure} == {"azure"}


def test_vidur_splitwise_conv_is_the_azure_conv_trace(azure):
    vidur = load_vidur(public(VIDUR))
    assert len(vidur) == len(azure)
    for field in ("prompt_tokens", "output_tokens"):
        assert (column(vidur, field) == column(azure, field)).all()
    shifted = column(vidur, "arrival") - vidur[0].arrival
    np.testing.assert_allclose(shifted, column(azure, "arrival"), rtol=0, atol=1e-6)


def test_azure_timestamps_keep_seven_fraction_digits_and_offsets(tmp_path):
    path = tmp_path / "azure.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\r\n"
                    "2023-11-16 18:15:46.0000001,1,0\r\n"
                    "2023-11-16 18:15:46.0000004,2,0\r\n"  # 7th digit: microseconds would make this 0
                    "2023-11-16T18:15:47Z,3,0\r\n"
                    "2023-11-16 18:15:47.5+00:00,4,0\r\n"
                    "2023-11-16 20:15:50+01:00,5,7")  # 19:15:50 UTC; no final newline
    got = load_azure(path)
    expected = [0.0, 3e-7, 1 - 1e-7, 1.5 - 1e-7, 3604 - 1e-7]  # 3604 = 19:15:50 - 18:15:46
    assert [r.arrival for r in got] == pytest.approx(expected, abs=1e-12)
    assert [r.prompt_tokens for r in got] == [1, 2, 3, 4, 5] and got[-1].output_tokens == 7


def test_blank_lines_are_skipped_and_do_not_shift_line_numbers(tmp_path):
    path = tmp_path / "blank.csv"
    path.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n0.0,5,1\n\n1.0,6,0\n  \n2.0,x,1\n\n\n")
    with pytest.raises(TraceError) as err:
        load_vidur(path)
    assert (err.value.path, err.value.line) == (str(path), 6)
    path.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n0.0,5,1\n\n1.0,6,0\n\n\n")
    assert load_vidur(path) == [Request(0.0, 5, 1, "vidur"), Request(1.0, 6, 0, "vidur")]


# --- bad files: each refused with the file, the line and the reason ------------------------------

AZURE_HEAD = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
VIDUR_HEAD = "arrived_at,num_prefill_tokens,num_decode_tokens\n"
GOOD_STAMP = "2023-11-16 18:15:46.6805900"


@pytest.mark.parametrize("loader, text, line, words", [
    (load_azure, "TIMESTAMP,ContextTokens\n2023-11-16 18:15:46,5\n", 1,
     ["missing column", "GeneratedTokens"]),
    (load_azure, AZURE_HEAD + f"{GOOD_STAMP},5,1\n2023-11-16 25:00:00,5,1\n", 3, ["TIMESTAMP", "ISO 8601"]),
    (load_azure, AZURE_HEAD + f"{GOOD_STAMP},5,1\n16/11/2023 18:15,5,1\n", 3, ["TIMESTAMP"]),
    (load_azure, AZURE_HEAD + f"{GOOD_STAMP},5,1\n{GOOD_STAMP},12.5,1\n", 3,
     ["ContextTokens", "not an integer"]),
    (load_azure, AZURE_HEAD + f"{GOOD_STAMP},5,1\n{GOOD_STAMP},5,1\n{GOOD_STAMP},5,-3", 4,
     ["GeneratedTokens", "negative"]),
    (load_azure, AZURE_HEAD + f"{GOOD_STAMP},0,1\n", 2, ["ContextTokens", "below 1"]),
    (load_azure, AZURE_HEAD + f"{GOOD_STAMP},5,1\n2023-11-16 18:15:45,5,1\n", 3, ["back in time", "line 2"]),
    (load_azure, AZURE_HEAD + f"{GOOD_STAMP},5,1,9\n", 2, ["expected 3 fields"]),
    (load_azure, AZURE_HEAD + f"{GOOD_STAMP},,1\n", 2, ["ContextTokens is empty"]),
    (load_vidur, "arrived_at,num_prefill_tokens\n0.0,5\n", 1, ["missing column", "num_decode_tokens"]),
    (load_vidur, VIDUR_HEAD + "0.0,5,1\n1.0,five,1\n", 3, ["num_prefill_tokens", "not a number"]),
    (load_vidur, VIDUR_HEAD + "0.0,5,1\n1.0,5,1.5\n", 3, ["num_decode_tokens", "not an integer"]),
    (load_vidur, VIDUR_HEAD + "-1.0,5,1\n", 2, ["arrived_at", "negative"]),
    # The earliest bad line wins, whichever column it is in.
    (load_vidur, VIDUR_HEAD + "0.0,5,1\n1.0,5,-1\n2.0,-5,1\n", 3, ["num_decode_tokens"]),
    (load_lengths, "num_prefill_tokens,num_total_tokens\n5,6\n", 1, ["missing column", "num_decode_tokens"]),
    (load_lengths, "num_prefill_tokens,num_decode_tokens,num_total_tokens\n5,1,6\n5,1,7\n", 3,
     ["num_total_tokens", "5 + 1"]),
    (load_lengths, "num_prefill_tokens,num_decode_tokens\n5,1\n-5,1\n", 3, ["num_prefill_tokens"]),
    (load_lengths, "num_prefill_tokens,num_decode_tokens\n\n", 1, ["header only"]),
    (load_lengths, "\n\n", 1, ["empty file"]),
])
def test_bad_csv_rows_are_refused_naming_file_and_line(tmp_path, loader, text, line, words):
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(TraceError) as err:
        loader(path)
    assert (err.value.path, err.value.line) == (str(path), line)
    for word in words:
        assert word in err.value.reason
    assert f"{path}:{line}" in str(err.value)


def mooncake_line(ts=0, n=600, out=1, ids=(0, 1)) -> str:
    return json.dumps({"timestamp": ts, "input_length": n, "output_length": out, "hash_ids": list(ids)})


@pytest.mark.parametrize("lines, line, words", [
    ([mooncake_line(), '{"timestamp": 1, "input_length": 600,'], 2, ["not valid JSON"]),
    ([mooncake_line(), mooncake_line(ts=5), mooncake_line(ts=9, ids=(0,))], 3,
     ["hash_ids has 1 ids", "ceil(600 / 512) = 2"]),
    ([mooncake_line(n=1025, ids=(0, 1))], 1, ["hash_ids has 2 ids", "= 3"]),
    ([mooncake_line(), '{"timestamp": 1, "input_length": 600, "hash_ids": [0, 1]}'], 2,
     ["missing field 'output_length'"]),
    ([mooncake_line(), mooncake_line(out=-1)], 2, ["output_length", "non-negative"]),
    ([mooncake_line(n=600.5)], 1, ["input_length", "integer"]),
    ([mooncake_line(ids=(0, "1"))], 1, ["hash_ids", "integers"]),
    ([mooncake_line(ts=10), mooncake_line(ts=9)], 2, ["back in time", "line 1"]),
    ([mooncake_line(ts="now")], 1, ["timestamp"]),
    (["[1, 2]"], 1, ["JSON object"]),
    # id 1 is block 1 of line 1 (a prefix of 2 blocks), so it cannot be block 0 of line 2
    ([mooncake_line(ids=(0, 1)), mooncake_line(ts=5, ids=(1, 2))], 2,
     ["hash id 1 names block 0 here but block 1 on line 1"]),
])
def test_bad_mooncake_lines_are_refused_naming_file_and_line(tmp_path, lines, line, words):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(TraceError) as err:
        load_mooncake(path)
    assert (err.value.path, err.value.line) == (str(path), line)
    for word in words:
        assert word in err.value.reason


def test_mooncake_allows_zero_outputs_and_blank_lines(tmp_path):
    path = tmp_path / "ok.jsonl"
    path.write_text(mooncake_line(ts=0, out=0) + "\n\n" + mooncake_line(ts=1500, n=512, ids=(0,)) + "\n\n")
    got = load_mooncake(path)
    assert got == [Request(0.0, 600, 0, "mooncake", (0, 1), 512), Request(1.5, 512, 1, "mooncake", (0,), 512)]


def test_unknown_format_is_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown trace format 'parquet'.*azure"):
        load_requests(tmp_path / "x", "parquet")


# --- lengths-only files ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sharegpt():
    return load_lengths(public(SHAREGPT), rate=4.0, seed=7)


@pytest.fixture(scope="module")
def arxiv():
    return load_lengths(public(ARXIV), rate=4.0, seed=7)


@pytest.mark.parametrize("rel, rows, loaded", [(SHAREGPT, 30_731, "sharegpt"), (ARXIV, 28_257, "arxiv")])
def test_length_files_load_with_poisson_arrivals(request, rel, rows, loaded):
    got = request.getfixturevalue(loaded)
    assert len(got) == rows and got[0].arrival == 0.0 and {r.tenant for r in got} == {"lengths"}
    with open(public(rel), newline="") as f:
        first = next(csv.DictReader(f))
    assert (got[0].prompt_tokens, got[0].output_tokens) == (int(first["num_prefill_tokens"]),
                                                             int(first["num_decode_tokens"]))
    # Exponential gaps: the mean gap is 1 / rate within 5 standard errors, 5 * (1/4) / sqrt(n - 1).
    gaps = np.diff(column(got, "arrival"))
    assert (gaps >= 0).all() and abs(gaps.mean() - 1 / 4.0) < 5 * 0.25 / math.sqrt(rows - 1)


def test_length_file_arrivals_are_deterministic_for_a_seed(sharegpt):
    assert load_lengths(public(SHAREGPT), rate=4.0, seed=7) == sharegpt
    other = load_lengths(public(SHAREGPT), rate=4.0, seed=8)
    assert [r.arrival for r in other] != [r.arrival for r in sharegpt]
    assert [(r.prompt_tokens, r.output_tokens) for r in other] == \
        [(r.prompt_tokens, r.output_tokens) for r in sharegpt]


def test_sharegpt_lengths_match_its_source_notes(sharegpt):
    prompt, output = column(sharegpt, "prompt_tokens"), column(sharegpt, "output_tokens")
    assert round(prompt.mean(), 1) == 2340.0 and np.median(prompt) == 1730 and prompt.max() == 8141
    assert round(output.mean(), 1) == 438.7 and np.median(output) == 415 and output.max() == 1024


def test_length_file_gamma_arrivals_have_the_stated_cv():
    got = load_lengths(public(ARXIV), rate=2.0, law="gamma", cv=3.0, seed=1)
    gaps = np.diff(column(got, "arrival"))
    n = len(gaps)
    # Gamma of shape k = 1/9: the mean's standard error is cv/rate/sqrt(n); the CV estimate's relative
    # error is about sqrt((2 + 6/k) / n) / 2 (variance of s^2 with excess kurtosis 6/k). 5 of each.
    assert abs(gaps.mean() * 2.0 - 1) < 5 * 3.0 / math.sqrt(n)
    assert abs(gaps.std() / gaps.mean() / 3.0 - 1) < 5 * math.sqrt((2 + 6 * 9) / n) / 2


def test_length_file_caps_and_law_checks(tmp_path):
    path = tmp_path / "lengths.csv"
    path.write_text("num_prefill_tokens,num_decode_tokens\n5,0\n6,1\n7,2\n")
    got = load_lengths(path, max_requests=2, tenant="t")
    assert [(r.prompt_tokens, r.output_tokens, r.tenant) for r in got] == [(5, 0, "t"), (6, 1, "t")]
    with pytest.raises(ValueError, match="cv"):
        load_lengths(path, law="gamma")
    with pytest.raises(ValueError, match="cv 1"):
        load_lengths(path, cv=2.0)
    with pytest.raises(ValueError, match="unknown arrival law"):
        load_lengths(path, law="pareto")
    with pytest.raises(ValueError, match="rate"):
        load_lengths(path, rate=0)


# --- Mooncake: prefix hashes ---------------------------------------------------------------------------

def test_mooncake_rows_and_lengths_match_the_readme(mooncake):
    with open(public(MOONCAKE)) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    assert len(mooncake) == len(rows) == 3993
    assert all(len(row["hash_ids"]) == math.ceil(row["input_length"] / 512) for row in rows)
    assert [r.block_hashes for r in mooncake] == [tuple(row["hash_ids"]) for row in rows]
    assert [r.arrival for r in mooncake] == [row["timestamp"] / 1000 for row in rows]
    assert round(column(mooncake, "prompt_tokens").mean(), 1) == 15325.5
    assert round(column(mooncake, "output_tokens").mean(), 1) == 149.1


def test_mooncake_unbounded_prefix_hit_rate_is_64_percent(mooncake):
    block_hits, block_refs, token_hits, token_refs = prefix_hit_rate_unbounded(mooncake)
    assert round(100 * block_hits / block_refs, 1) == 64.0
    assert block_refs == sum(math.ceil(r.prompt_tokens / 512) for r in mooncake)
    assert token_refs == sum(r.prompt_tokens for r in mooncake)  # every prompt token is in one block
    assert 0 < token_hits <= block_hits * 512


def test_mooncake_rehash_keeps_full_blocks_and_shared_prefixes(mooncake):
    by_512 = rehash_requests(mooncake, 512)
    by_256 = rehash_requests(mooncake, 256)
    for r, r512, r256 in zip(mooncake, by_512, by_256):
        assert len(r512.block_hashes) == r.prompt_tokens // 512 and r512.hash_block_size == 512
        assert len(r256.block_hashes) == r.prompt_tokens // 256
        assert r512.block_hashes == r.block_hashes[: r.prompt_tokens // 512]  # k = 1: ids unchanged
    hits_512, refs_512, _, tokens_512 = prefix_hit_rate_unbounded(by_512)
    hits_256, refs_256, _, tokens_256 = prefix_hit_rate_unbounded(by_256)
    assert tokens_512 == sum(r.prompt_tokens // 512 * 512 for r in mooncake)
    assert tokens_256 == sum(r.prompt_tokens // 256 * 256 for r in mooncake)
    assert hits_256 >= 2 * hits_512  # a shared 512-block is two shared 256-blocks


def test_split_block_hashes_by_hand():
    # Two prompts share their first 512-block (id 0) and part in the second (ids 1 and 2).
    # B = 256, k = 2: 700 // 256 = 2 and 600 // 256 = 2 full blocks, both inside id 0.
    assert split_block_hashes([0, 1], 700, 256) == (0 * 2 + 0, 0 * 2 + 1)
    assert split_block_hashes([0, 2], 600, 256) == (0, 1)
    # B = 128, k = 4: 700 // 128 = 5 blocks, the fifth is id 1's first sub-block 1 * 4 + 0.
    assert split_block_hashes([0, 1], 700, 128) == (0, 1, 2, 3, 4)
    assert split_block_hashes([0, 2], 600, 128) == (0, 1, 2, 3)
    # A different 512-block never shares a sub-block: id 2 * 4 + 0 = 8 vs 1 * 4 + 0 = 4.
    assert split_block_hashes([0, 2], 700, 128)[-1] == 8
    assert split_block_hashes([7], 100, 128) == ()  # no full block
    for bad in (0, 384, 1024, -128):
        with pytest.raises(ValueError, match="divisor of 512"):
            split_block_hashes([0], 512, bad)
    with pytest.raises(ValueError, match="cannot cover"):
        split_block_hashes([0], 1024, 256)


def test_prefix_hit_rate_by_hand():
    a = Request(0.0, 700, 1, block_hashes=(0, 1), hash_block_size=512)
    b = Request(1.0, 600, 1, block_hashes=(0, 2), hash_block_size=512)
    # Blocks: a = 512 + 188 tokens, b = 512 + 88; only id 0 repeats.
    assert prefix_hit_rate_unbounded([a, b]) == (1, 4, 512, 700 + 600)
    # B = 128: a has 5 full blocks, b 4, all of b's inside the shared id 0.
    assert prefix_hit_rate_unbounded(rehash_requests([a, b], 128)) == (4, 9, 4 * 128, 9 * 128)
    # A partial block cached at 100 tokens gives at most 100 tokens to a later 300-token reference;
    # after that, 300 are cached: a 200-token reference hits all 200.
    part = [Request(0.0, n, 0, block_hashes=("x",), hash_block_size=512) for n in (100, 300, 200)]
    assert prefix_hit_rate_unbounded(part) == (2, 3, 100 + 200, 100 + 300 + 200)
    with pytest.raises(ValueError, match="no block hashes"):
        prefix_hit_rate_unbounded([Request(0.0, 5, 1)])
    with pytest.raises(ValueError, match="overrun"):
        prefix_hit_rate_unbounded([Request(0.0, 512, 1, block_hashes=(0, 1), hash_block_size=512)])


def test_mooncake_loader_can_rehash_on_load(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text(mooncake_line(n=700, ids=(0, 1)) + "\n" + mooncake_line(ts=1, n=600, ids=(0, 2)))
    got = load_mooncake(path, block_size=128)
    assert [r.block_hashes for r in got] == [(0, 1, 2, 3, 4), (0, 1, 2, 3)]
    assert {r.hash_block_size for r in got} == {128}


# --- ServeGen: per-client windows into a tenant mix ------------------------------------------------

def test_servegen_sample_is_a_two_tenant_mix(servegen_6h):
    assert {r.tenant for r in servegen_6h} == {LANGUAGE, DEEPSEEK}
    arrival = column(servegen_6h, "arrival")
    assert (np.diff(arrival) >= 0).all() and arrival[0] >= 0 and arrival[-1] < 6 * 3600
    # deepseek's windows before 2400 s have rate 0 (its trace's first rows).
    with open(public(SERVEGEN) / f"{DEEPSEEK}-trace.csv") as f:
        first_active = min(float(row[0]) for row in csv.reader(f) if float(row[1]) > 0)
    assert first_active == 2400
    assert min(r.arrival for r in servegen_6h if r.tenant == DEEPSEEK) >= first_active


def test_servegen_lengths_come_from_the_window_pdf(servegen_6h):
    # Dataset windows are 6 h long: every request of the first 6 h uses the PDFs of window "0".
    for client in (LANGUAGE, DEEPSEEK):
        with open(public(SERVEGEN) / f"{client}-dataset.json") as f:
            window = json.load(f)["0"]
        inputs, outputs = (set(ast.literal_eval(window[k])) for k in ("input_tokens", "output_tokens"))
        mine = [r for r in servegen_6h if r.tenant == client]
        assert mine
        assert {r.prompt_tokens for r in mine} <= inputs and {r.output_tokens for r in mine} <= outputs


def test_servegen_is_deterministic_and_caps_select(servegen_6h):
    path = public(SERVEGEN)
    assert load_servegen(path, seed=0, duration=6 * 3600) == servegen_6h
    assert load_servegen(path, seed=1, duration=6 * 3600) != servegen_6h
    assert load_servegen(path, seed=0, duration=3600) == [r for r in servegen_6h if r.arrival < 3600]
    assert load_servegen(path, seed=0, max_requests=200) == servegen_6h[:200]
    later = load_servegen(path, seed=0, start=3600, duration=3600)
    expected = [r for r in servegen_6h if 3600 <= r.arrival < 7200]
    assert [(r.tenant, r.prompt_tokens, r.output_tokens) for r in later] == \
        [(r.tenant, r.prompt_tokens, r.output_tokens) for r in expected]
    assert [r.arrival for r in later] == pytest.approx([r.arrival - 3600 for r in expected], abs=1e-9)


def write_servegen(folder: Path, name: str, trace: str, dataset: dict) -> None:
    (folder / f"{name}-trace.csv").write_text(trace)
    (folder / f"{name}-dataset.json").write_text(json.dumps(dataset, indent=2))


def test_servegen_windows_by_hand(tmp_path):
    # Client a: Gamma CV 0.5 at 2 req/s, an idle window, Weibull shape 1.5 at 1 req/s; b: Poisson 0.5/s.
    write_servegen(tmp_path, "a", "0,2.0,0.5,Gamma,4.0,0.125\n600,0,0,,0,0\n1200,1.0,0.68,Weibull,1.5,1.1",
                   {"0": {"input_tokens": "{100: 1.0}", "output_tokens": "{0: 0.5, 7: 0.5}"},
                    "1200": {"input_tokens": "{50: 0.25, 60: 0.75}", "output_tokens": "{3: 1.0}"}})
    write_servegen(tmp_path, "b", "0,0.5,1.0,Exponential,0,0\n", {"0": {"input_tokens": "{9: 1}",
                                                                      "output_tokens": "{1: 1}"}})
    got = load_requests(tmp_path, "servegen", seed=3)
    a = [r for r in got if r.tenant == "a"]
    first = [r for r in a if r.arrival < 600]
    third = [r for r in a if r.arrival >= 1200]
    assert not [r for r in a if 600 <= r.arrival < 1200] and max(r.arrival for r in a) < 1800
    # Renewal counts: mean rate * 600, sd sqrt(rate * 600) * CV; 5 sd.
    assert abs(len(first) - 1200) < 5 * math.sqrt(1200) * 0.5  # 1200 = 2.0 * 600
    assert abs(len(third) - 600) < 5 * math.sqrt(600) * 0.68  # Weibull k = 1.5 has CV 0.68
    assert {r.prompt_tokens for r in first} == {100} and {r.output_tokens for r in first} == {0, 7}
    assert {r.prompt_tokens for r in third} == {50, 60} and {r.output_tokens for r in third} == {3}
    b = [r for r in got if r.tenant == "b"]
    assert abs(len(b) - 300) < 5 * math.sqrt(300)  # 300 = 0.5 * 600
    assert {(r.prompt_tokens, r.output_tokens) for r in b} == {(9, 1)}
    assert len(load_servegen(tmp_path / "b-trace.csv", seed=3)) == len(b)  # one client alone: same draws


@pytest.mark.parametrize("trace, dataset, where, line, words", [
    ("0,1.0,1.0,Gamma,1.0,1.0\n600,1.0,2.0,Pareto,1.0,1.0\n", None, "trace", 2, ["'Pareto'", "not known"]),
    ("0,1.0,1.0,Gamma,1.0,1.0\n600,-1.0,0,,0,0\n", None, "trace", 2, ["rate", "negative"]),
    ("0,1.0,1.0,Gamma,0,1.0\n", None, "trace", 1, ["shape", "positive"]),
    ("0,1.0,1.0,Gamma,1.0,1.0\n0,1.0,1.0,Gamma,1.0,1.0\n", None, "trace", 2, ["window_start"]),
    ("0,1.0,1.0,Gamma,1.0\n", None, "trace", 1, ["expected 6 fields"]),
    ("0,1.0,1.0,Gamma,1.0,1.0\n", {"0": {"input_tokens": "{}", "output_tokens": "{1: 1}"}},
     "dataset", 3, ["input_tokens", "empty"]),
    ("0,1.0,1.0,Gamma,1.0,1.0\n", {"0": {"input_tokens": "{0: 1}", "output_tokens": "{1: 1}"}},
     "dataset", 3, ["0 tokens"]),
    ("0,1.0,1.0,Gamma,1.0,1.0\n", {"600": {"input_tokens": "{5: 1}", "output_tokens": "{1: 1}"}},
     "trace", 1, ["no length distribution"]),
])
def test_bad_servegen_files_are_refused(tmp_path, trace, dataset, where, line, words):
    good = {"0": {"input_tokens": "{5: 1}", "output_tokens": "{1: 1}"}}
    write_servegen(tmp_path, "c", trace, dataset or good)
    with pytest.raises(TraceError) as err:
        load_servegen(tmp_path, duration=600)
    bad_file = tmp_path / ("c-trace.csv" if where == "trace" else "c-dataset.json")
    assert (err.value.path, err.value.line) == (str(bad_file), line)
    for word in words:
        assert word in err.value.reason


def test_servegen_needs_the_dataset_next_to_the_trace(tmp_path):
    (tmp_path / "d-trace.csv").write_text("0,1.0,1.0,Gamma,1.0,1.0\n")
    with pytest.raises(TraceError, match="d-dataset.json are missing"):
        load_servegen(tmp_path)
    with pytest.raises(TraceError, match="no such file"):
        load_servegen(tmp_path / "nothing-here")
