# Sourced by the GPU machine scripts (check.sh, torch.sh): the environment every run there needs.
# NVLink multicast off (NVLS; the lent machines must not use it), NCCL peers connected when a
# communicator is created, mpirun as root allowed, unbuffered Python output; the Python
# packages installed from .gpu/wheels.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export NCCL_RUNTIME_CONNECT=${NCCL_RUNTIME_CONNECT:-0}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PYTHONUNBUFFERED=1
out=${OUT:-/tmp/ferrovod-gpu}
mkdir -p "$out"
ngpu=$(nvidia-smi -L | wc -l)
# ferrovod's wheel and the tests' pure-Python wheels (scripts/gpu/prepare.sh put them in
# .gpu/wheels), installed into this machine's Python with pip, once per wheel
if compgen -G "$PWD/.gpu/wheels/ferrovod-*.whl" >/dev/null; then
  stamp=$(cat "$PWD"/.gpu/wheels/*.whl | sha1sum | cut -c1-16)
  if [ "$(cat "$HOME/.ferrovod-wheels" 2>/dev/null)" != "$stamp" ]; then
    python3 -m pip install -q --no-index --no-deps --force-reinstall "$PWD"/.gpu/wheels/*.whl &&
      echo "$stamp" >"$HOME/.ferrovod-wheels"
  fi
fi
