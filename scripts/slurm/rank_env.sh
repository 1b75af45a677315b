#!/usr/bin/env bash
# Per-rank wrapper that srun starts once per task (see common.sh):
# exports the torch.distributed variables from Slurm's and execs the command.
#
#   RANK        = SLURM_PROCID
#   WORLD_SIZE  = SLURM_NTASKS
#   LOCAL_RANK  = 0 when LAUNCH_LOCAL_RANK=zero (one visible GPU per task, it
#                 is device 0), else SLURM_LOCALID (all GPUs of the node visible)
#   LOCAL_WORLD_SIZE = SLURM_NTASKS_PER_NODE
#
# SLURM_LOCALID / SLURM_NODEID stay untouched, so the node-local topology
# (shared-memory loader, hierarchical ZeRO groups) still sees the real index.
set -euo pipefail

if [[ -z "${SLURM_PROCID:-}" || -z "${SLURM_NTASKS:-}" || -z "${SLURM_LOCALID:-}" ]]; then
    echo "error: $(basename "$0") must run under srun (SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID unset)" >&2
    exit 2
fi

export RANK="$SLURM_PROCID"
export WORLD_SIZE="$SLURM_NTASKS"
case "${LAUNCH_LOCAL_RANK:-slurm}" in
zero) export LOCAL_RANK=0 ;;
slurm) export LOCAL_RANK="$SLURM_LOCALID" ;;
*)
    echo "error: LAUNCH_LOCAL_RANK='${LAUNCH_LOCAL_RANK}' must be 'zero' or 'slurm'" >&2
    exit 2
    ;;
esac
if [[ -n "${SLURM_NTASKS_PER_NODE:-}" ]]; then
    export LOCAL_WORLD_SIZE="${SLURM_NTASKS_PER_NODE%%(*}"
fi

# Node-local caches (e.g. MIOpen's database) must exist on every node.
for dir in "${MIOPEN_USER_DB_PATH:-}" "${MIOPEN_CUSTOM_CACHE_DIR:-}"; do
    if [[ -n "$dir" ]]; then
        mkdir -p "$dir"
    fi
done

exec "$@"
