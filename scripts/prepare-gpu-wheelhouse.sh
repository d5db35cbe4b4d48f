#!/usr/bin/env bash
# Fill .whl/ (git-ignored) with the wheels that the swarm part of `make gpu-proof` needs on a GPU machine without
# network: hivemind 1.1.12 and those of its dependencies the GPU image lacks, plus boto3 and its own (the
# coordinator's checkpoint store imports boto3). Run it where PyPI is reachable; bring .whl/ along to the GPU machine,
# where `python -m benchmarks.gpu_proof` installs it when hivemind is missing, or by hand:
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
#   PYTHONPATH=/tmp/site:. python3 -m benchmarks.gpu_proof
#
# Environment: PYTHON_VERSION (default 3.12, the GPU machines' Python), WHEELHOUSE (default .whl).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON_VERSION="${PYTHON_VERSION:-3.12}"
WHEELHOUSE="${WHEELHOUSE:-.whl}"
LIMIT_BYTES=$((64 * 1024 * 1024))  # what the GPU machine's run tool carries along with the working tree

# hivemind's Requires-Dist (unzip -p .whl/hivemind-*.whl '*/METADATA' | grep ^Requires-Dist), followed down, less
# what the GPU image has (torch, numpy, scipy, PyYAML, packaging, protobuf, grpcio, typing-extensions, setuptools come
# with torch, lightning, scikit-learn and tensorboard); the versions are those this project's .venv runs (pip freeze).
# idna is kept although the image has it through huggingface_hub's HTTP client: pure Python, and hivemind needs it.
BINARY_WHEELS=(
  hivemind==1.1.12
  msgpack==1.2.4 sortedcontainers==2.4.0 uvloop==0.23.0 grpcio-tools==1.85.1 ConfigArgParse==1.9.0
  py-multihash==3.0.0 morphys==1.0 base58==2.1.1 blake3==1.0.11 mmh3==5.3.1 six==1.17.0
  cryptography==50.0.2 cffi==2.1.1 pycparser==3.12
  pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  netaddr==1.3.0 idna==3.20 py-cid==0.5.0 py-multibase==2.0.0 py-multicodec==1.0.0
  boto3==1.44.8 botocore==1.44.8 s3transfer==0.19.3 jmespath==1.1.0 urllib3==2.8.0
)
# Published as source only. They are pure Python, so a wheel built here (py3-none-any) installs on any Python 3.
SOURCE_ONLY=(prefetch_generator==1.0.3 varint==1.0.2 python-baseconv==1.2.2)

rm -rf "$WHEELHOUSE"
mkdir -p "$WHEELHOUSE"
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version "$PYTHON_VERSION" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$WHEELHOUSE" "${BINARY_WHEELS[@]}"
python3 -m pip wheel --quiet --no-deps --no-binary=:all: -w "$WHEELHOUSE" "${SOURCE_ONLY[@]}"

for wheel in "$WHEELHOUSE"/*.whl; do
  case "$wheel" in
    *-none-any.whl | *-manylinux*.whl) ;;
    *) echo "error: $wheel is built for this machine only, not for the GPU machines" >&2; exit 1 ;;
  esac
done
count=$(ls "$WHEELHOUSE"/*.whl | wc -l)
expected=$(( ${#BINARY_WHEELS[@]} + ${#SOURCE_ONLY[@]} ))
if [ "$count" -ne "$expected" ]; then
  echo "error: $WHEELHOUSE holds $count wheels, expected $expected" >&2
  exit 1
fi
bytes=$(cat "$WHEELHOUSE"/*.whl | wc -c)
if [ "$bytes" -gt "$LIMIT_BYTES" ]; then
  echo "error: $WHEELHOUSE holds $((bytes / 1024 / 1024)) MiB of wheels, more than the 64 MiB a GPU machine is sent" >&2
  exit 1
fi
echo "$WHEELHOUSE: $count wheels for Python $PYTHON_VERSION, $((bytes / 1024)) KiB"
