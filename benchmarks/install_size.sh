#!/usr/bin/env bash
# The size and time of each way of installing the package into a fresh venv (docs/install.md,
# "CPU-only machines and CI"). Builds the wheel of this checkout, installs it each way, and appends
# one line per way to benchmarks/results/install_size.txt with the machine, the load and the time.
#
#   bash benchmarks/install_size.sh [default] [cpu_index] [cpu_disk] [checkout]
#
# default:   pip install WHEEL                    (pip resolves torch from PyPI: the CUDA build)
# cpu_index: pip install WHEEL --extra-index-url https://download.pytorch.org/whl/cpu
#            (torch's +cpu builds rank above PyPI's CUDA build of the same release, within the package's range)
# cpu_disk:  pip install torch==2.13.0 WHEEL      (a CPU torch wheel found through pip's find-links)
# checkout:  make install's own line, pip install -e ".[all,test]"
# A way whose index cannot be reached is recorded as failed, with pip's last line.
set -u
cd "$(dirname "$0")/.."
ROOT=$PWD
WORK=${WORK:-$(mktemp -d)}
OUT=$ROOT/benchmarks/results/install_size.txt
PY=${PYTHON:-python3.11}
ways=("$@"); [ ${#ways[@]} -eq 0 ] && ways=(default cpu_index cpu_disk)
"$PY" -m pip wheel --no-deps -q -w "$WORK/wheel" . >/dev/null
WHEEL=$(ls "$WORK"/wheel/*.whl)
for way in "${ways[@]}"; do
  venv=$WORK/venv-$way
  rm -rf "$venv"; "$PY" -m venv "$venv"
  pip=("$venv/bin/python" -m pip install -q)
  start=$(date +%s); load=$(cut -d' ' -f1 /proc/loadavg)
  case $way in
    default) "${pip[@]}" "$WHEEL" ;;
    # --retries/--timeout: where the index is unreachable, pip gives up on it in a minute rather than fifteen
    # (and goes on without it: the line's versions say which torch it took)
    cpu_index) "${pip[@]}" --retries 1 --timeout 30 --extra-index-url https://download.pytorch.org/whl/cpu "$WHEEL" ;;
    cpu_disk) "${pip[@]}" torch==2.13.0 "$WHEEL" ;;
    checkout) (cd "$ROOT" && "${pip[@]}" -e ".[all,test]") ;;
    *) echo "unknown way: $way (default, cpu_index, cpu_disk, checkout)" >&2; exit 2 ;;
  esac > "$WORK/$way.log" 2>&1
  rc=$?
  seconds=$(( $(date +%s) - start ))
  site=$(echo "$venv"/lib/python3*/site-packages)
  size=$(du -sm "$venv" | cut -f1)
  cuda=$(du -smc "$site"/nvidia* "$site"/triton* 2>/dev/null | tail -1 | cut -f1)
  torch=$(du -sm "$site/torch" 2>/dev/null | cut -f1)
  versions=$("$venv/bin/python" -c "import importlib.metadata as m; print('torch', m.version('torch'), 'torchvision', m.version('torchvision'))" 2>/dev/null)
  imports=$("$venv/bin/python" -c "import torchvision.ops; print('ok')" 2>&1 | tail -1)
  [ $rc -ne 0 ] && versions="failed: $(tail -1 "$WORK/$way.log")"
  echo "$(date -u -d @"$start" +%FT%TZ) way=$way rc=$rc seconds=$seconds venv_mb=$size torch_mb=${torch:-0} nvidia_triton_mb=${cuda:-0} $versions torchvision_imports=[$imports] load_at_start=$load machine=$(hostname) cpus=$(nproc) cpu='$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)'" | tee -a "$OUT"
  rm -rf "$venv"
done
