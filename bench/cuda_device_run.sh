#!/bin/bash
# One device run for issue #31 (bench/fix_cost.py --device cuda and the #8913 reproducer's GPU path), written to
# run on a machine with one GPU, whose Python has torch but neither DeepSpeed nor simdist installed.
# Prepare build/devsite here first (build/ is ignored by git):
#   S=<venv>/lib/python3.11/site-packages; mkdir -p build/devsite
#   cp -r $S/deepspeed $S/hjson $S/pydantic $S/annotated_types $S/typing_inspection build/devsite/
#   for v in 3.10 3.11 3.12 3.13; do pip download --no-deps --only-binary=:all: --python-version $v --implementation cp \
#       --platform manylinux_2_17_x86_64 -d build/devsite/whl pydantic_core==<the venv's version>; done
#   simdist case export production build/devsite/pkg --only deepspeed-8913
#   cp bench/cuda_device_run.sh build/devsite/device.sh
# then run `bash build/devsite/device.sh` there with build/devsite carried; results land under $OUT.
exec > >(tee "$OUT/device.log") 2>&1
export PYTHONUNBUFFERED=1
ROOT=$PWD; D=$ROOT/build/devsite
echo "== where: $(pwd) branch: $(git rev-parse --abbrev-ref HEAD 2>/dev/null) commit: $(git rev-parse HEAD 2>/dev/null)"
ls bench/fix_cost.py simdist/models/production.py build/devsite | head -20
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c 'import sys,torch;print(sys.version.split()[0], torch.__version__, torch.cuda.is_available(), torch.cuda.device_count())'
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site --find-links $D/whl pydantic_core==2.50.5 || echo "pip offline install FAILED"
export PYTHONPATH=$ROOT:$D:/tmp/site DS_BUILD_OPS=0
python3 -c 'import deepspeed, simdist.models.production as p; print("deepspeed", deepspeed.__version__, "accelerator", deepspeed.accelerator.get_accelerator()._name)' || { echo "import FAILED"; exit 3; }
echo "== fix_cost --device cuda (4 gloo processes, all on cuda:0)"
timeout 130 python3 bench/fix_cost.py --device cuda --repeats 5 > $OUT/fix_cost_cuda.md; echo "fix_cost rc=$?"
cat $OUT/fix_cost_cuda.md
echo "== #8913 reproducer on CUDA, shipped (expect exit 1)"
cd $D/pkg/deepspeed-8913
timeout 60 torchrun --standalone --nproc-per-node 4 reproduce.py --size 32768 > $OUT/repro_shipped.txt 2>&1; echo "shipped rc=$?"
tail -5 $OUT/repro_shipped.txt
mkdir -p /tmp/dsfix && cp -r $D/deepspeed /tmp/dsfix/ && (cd /tmp/dsfix && patch -p1 < $D/pkg/deepspeed-8913/fix.diff)
echo "== #8913 reproducer on CUDA, with fix.diff (expect exit 0)"
PYTHONPATH=/tmp/dsfix:$PYTHONPATH timeout 60 torchrun --standalone --nproc-per-node 4 reproduce.py --size 32768 > $OUT/repro_fixed.txt 2>&1; echo "fixed rc=$?"
tail -5 $OUT/repro_fixed.txt
