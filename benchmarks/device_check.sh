#!/bin/bash
# The checks that need a GPU and many cores, as one script (docs/nodes.md, docs/performance.md):
# the GPU programs on yrdask.ray, the yr API and Ray, then `--only scale` for yrdask, Dask and
# Ray, then where a task burst's CPU goes.  Run from the repository root on a machine with
# Python 3.12, torch and no package index: the other packages come pre-installed in
# .whl/site312.tar.xz (docs/performance.md, "Many cores and a GPU: how the run is prepared").
# Usage: bash benchmarks/device_check.sh OUTDIR [CPUS] [SYSTEMS]
set -u
out=${1:?usage: device_check.sh OUTDIR [CPUS] [SYSTEMS]}
cpus=${2:-$(nproc)}
systems=${3:-yrdask,dask,ray}
site=""
if [ -f .whl/site312.tar.xz ]; then
  tar xJf .whl/site312.tar.xz -C /tmp || exit 1
  site=/tmp/site312
  export PYTHONPATH=/tmp/site312:$PWD
fi
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 RAY_USAGE_STATS_ENABLED=0
# Bytecode, as `pip install` writes it: the unpacked packages and this checkout hold only
# sources, and with PYTHONDONTWRITEBYTECODE every interpreter (each system's driver, yrdask's
# launcher, Dask's and Ray's worker processes) compiled them again, about 1 s more of every
# init_s on 16 cores (docs/changelog/performance-history.md,
# "2026-11-26: Start-up with many worker processes").
python3 -m compileall -q -j0 $site yrdask benchmarks examples >/dev/null \
  || echo "compileall reported errors: what it could not compile is compiled at every start"
# The machine's own packages that the systems import came without bytecode as well (numpy,
# jinja2, packaging, psutil, certifi, markupsafe: 125 modules on the H200 machine); where
# their folders are writable they get it too (a read-only image keeps compiling them).
img=$(python3 -c "import importlib.util as u, os; print(' '.join(os.path.dirname(s.origin)
  for n in ('numpy', 'jinja2', 'packaging', 'psutil', 'certifi', 'markupsafe')
  for s in [u.find_spec(n)] if s and s.origin))")
python3 -m compileall -q -j0 $img >/dev/null 2>&1 || echo "no bytecode written for: $img"
nproc; nvidia-smi -L; python3 -V
python3 -c "import ray, dask, torch; print('ray', ray.__version__, 'dask', dask.__version__, 'torch', torch.__version__, 'cuda', torch.cuda.is_available())"
step() { echo "== $1 ($(date +%T))"; shift; "$@"; echo "-- rc=$?"; }
step "GPU program on yrdask.ray" timeout 75 python3 -m yrdask.ray examples/gpu_torch.py
step "GPU program on the yr API" timeout 60 python3 examples/gpu_torch_yr.py
case $systems in *ray*) step "GPU program on Ray" timeout 90 python3 examples/gpu_torch.py;; esac
step "scale group, $cpus CPUs" timeout 300 python3 -m benchmarks --cpus "$cpus" --only scale \
  --runs 1 --systems "$systems" --out "$out/scale.json"
step "CPU per task, $cpus workers" timeout 45 python3 -m benchmarks.scale_cpu "$cpus" 20000
echo "== done ($(date +%T))"
