# Sourced by the GPU machine scripts (check.sh, torch.sh): the environment every run there needs.
# NVLink multicast off (NVLS; the lent machines must not use it), NCCL peers connected when a
# communicator is created, mpirun as root allowed, unbuffered Python output.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export NCCL_RUNTIME_CONNECT=${NCCL_RUNTIME_CONNECT:-0}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PYTHONUNBUFFERED=1
out=${OUT:-/tmp/ferrovod-gpu}
mkdir -p "$out"
ngpu=$(nvidia-smi -L | wc -l)
