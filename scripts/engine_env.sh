#!/usr/bin/env bash
# The opt-in engine environments of the README, as one command:
#
#   scripts/engine_env.sh vllm DIR      # vLLM 0.33.0's scheduler-side classes on CPU torch
#   scripts/engine_env.sh sglang DIR    # SGLang 0.5.23's mem_cache on CPU torch
#   scripts/engine_env.sh dynamo DIR    # NVIDIA Dynamo 1.6.1's KV router RadixTree (no torch):
#                                       # `kvbench route --dynamo` checks it against the reference
#   scripts/engine_env.sh lmcache DIR   # LMCache 0.5.6's LocalCPUBackend on CPU torch (lmcache-cpu)
#
# Run from the repository root. Idempotent: a DIR whose environment is complete (its marker file
# names the same recipe) is left as it is; a partial one is completed. Engines go in with --no-deps
# (their declared dependencies pull CUDA torch and GPU kernels, gigabytes, unused here), then the
# modules their KV-cache classes import, pinned: the versions these recipes were last run with.
# Costs, measured on the 2-core development machine: vllm 3.5 minutes and 2.3 GB; sglang 14 minutes
# under load (mostly downloads: triton is several hundred MB) and 2.6 GB; lmcache 1.5 minutes from
# pip's cache (9 minutes with the downloads, under load) and 2.2 GB. LMCache alone goes in with its
# declared dependencies: they pin no torch (the CPU wheel installed first stays), and its
# import pulls many of them (cupy, nvtx, prometheus, opentelemetry, ...) even on a CPU.
set -euo pipefail

engine=${1:?usage: scripts/engine_env.sh vllm|sglang|dynamo|lmcache DIR}
dir=${2:?usage: scripts/engine_env.sh vllm|sglang|dynamo|lmcache DIR}
[ -f pyproject.toml ] && grep -q '^name = "kvbench"' pyproject.toml \
  || { echo "engine_env.sh: run it from the kvbench repository root" >&2; exit 2; }

case "$engine" in
  vllm)
    engine_pkgs=(vllm==0.33.0)
    deps=(packaging==26.4 psutil==7.2.2 pyzmq==27.3.0 urllib3==2.8.0 regex==2026.11.19 numpy==2.4.6
          msgspec==0.23.0 pydantic==2.14.4 pydantic-core==2.50.5 typing-inspection==0.4.5
          annotated-types==0.8.0 cbor2==6.3.0 transformers==5.20.2 huggingface-hub==2.4.0 tqdm==4.70.1
          httpx2==2.16.2 httpcore2==2.16.2 idna==3.20 pyyaml==6.0.4 truststore==0.10.5 h11==0.16.0
          safetensors==0.8.0 tokenizers==0.23.3 aiohttp==3.14.5 multidict==7.2.1 attrs==26.1.0
          yarl==1.25.1 propcache==0.5.4 aiohappyeyeballs==2.7.1 aiosignal==1.4.0 frozenlist==1.8.0
          requests==2.34.2 certifi charset-normalizer==3.5.3 oss-harmony==0.0.11 openai==3.57.0
          sniffio==1.3.1 anyio==4.16.0 pillow==13.0.0 pybase64==1.5.1 cachetools==8.0.2
          cloudpickle==3.1.3 py-cpuinfo==9.0.0 uvloop==0.23.0 prometheus-client==0.26.0
          xgrammar==0.2.8 apache-tvm-ffi==0.1.11 fastapi==0.136.3 starlette==1.10.0
          annotated-doc==0.0.7 partial-json-parser==0.2.1.1.post7 llguidance==1.7.6)
    probe="from vllm.v1.core.block_pool import BlockPool; import vllm.v1.core.kv_cache_utils" ;;
  sglang)
    engine_pkgs=(sglang==0.5.23 torchvision==0.28.0 triton==3.9.0)
    deps=(numpy==2.4.6 orjson==3.13.0 psutil==7.2.2 pybase64==1.5.1 requests==2.34.2 urllib3==2.8.0
          idna==3.20 certifi charset-normalizer packaging==26.4 pillow==13.0.0 starlette==1.10.0
          anyio==4.16.0 msgspec==0.23.0 pydantic==2.14.4 pydantic-core==2.50.5
          typing-inspection==0.4.5 annotated-types==0.8.0 pyzmq==27.3.0 tqdm==4.70.1 ipython==9.18.1
          traitlets==5.16.1 pygments==2.21.0 aiohttp==3.14.5 multidict==7.2.1 attrs==26.1.0
          yarl==1.25.1 propcache==0.5.4 aiohappyeyeballs==2.7.1 aiosignal==1.4.0 frozenlist==1.8.0
          transformers==5.19.0 tokenizers==0.23.2 safetensors==0.8.0 regex==2026.11.19
          huggingface-hub==2.4.0 httpx2==2.16.2 httpcore2==2.16.2 h11==0.16.0 pyyaml==6.0.4
          truststore==0.10.5 dill==0.4.1 apache-tvm-ffi==0.1.11 sentencepiece==0.2.1
          compressed-tensors==0.18.0 loguru==0.7.3 gguf==0.19.0
          openai==3.57.0 sniffio==1.3.1 partial-json-parser==0.2.1.1.post7)  # UnifiedRadixCache's imports
    probe="import impls.engines.sglang_radix as s; ok, why = s.SglangRadix.available(); assert ok, why" ;;
  dynamo)  # the Rust indexer's wheel (manylinux_2_28 x86_64, abi3); the ai-dynamo package above
           # it pulls Kubernetes, transformers and the engines, none of which RadixTree needs
    engine_pkgs=(ai-dynamo-runtime==1.6.1)
    deps=(numpy==2.4.6 pydantic==2.13.5 pydantic-core==2.46.5 typing-inspection==0.4.5
          annotated-types==0.8.0 typing-extensions==4.16.0 uvloop==0.23.0 tqdm==4.70.1)
    probe="from kvbench.routing import dynamo; why = dynamo.available(); assert not why, why" ;;
  lmcache)
    engine_pkgs=(lmcache==0.5.6)
    deps=()
    with_deps=1  # its declared dependencies: LMCache imports them on a CPU too
    probe="import impls.engines.lmcache_cpu as m; ok, why = m.available(); assert ok, why" ;;
  *) echo "engine_env.sh: unknown engine '$engine' (vllm, sglang, dynamo or lmcache)" >&2; exit 2 ;;
esac

# kvbench's CLI and tests: pyproject's pytest options take pytest-xdist (--dist).
tools=(pandas matplotlib pyarrow fsspec ml_dtypes pytest pytest-xdist hypothesis pytest-benchmark)

# The marker names the whole recipe: a changed pin makes the environment incomplete again.
recipe="$engine ${engine_pkgs[*]} ${deps[*]} ${tools[*]}"
marker="$dir/.kvbench-engine-env"
if [ -f "$marker" ] && [ "$(cat "$marker")" = "$recipe" ]; then
  echo "$dir: the $engine environment is complete (nothing to do)"
  exit 0
fi

[ -x "$dir/bin/python" ] || python3 -m venv "$dir"
pip() { "$dir/bin/pip" install --quiet --disable-pip-version-check "$@"; }
[ "$engine" = dynamo ] || pip torch==2.13.0  # first: the CPU wheel (a bare torch is a CUDA build)
if [ "${with_deps:-0}" = 1 ]; then
  pip "${engine_pkgs[@]}"
else
  pip --no-deps "${engine_pkgs[@]}"
fi
[ ${#deps[@]} -eq 0 ] || pip --no-deps "${deps[@]}"
pip --no-deps -e .                      # kvbench itself, and what its CLI and tests need
pip "${tools[@]}"
"$dir/bin/python" -c "$probe"
echo "$recipe" > "$marker"
echo "$dir: the $engine environment is ready ($dir/bin/kvbench list shows its backends)"
