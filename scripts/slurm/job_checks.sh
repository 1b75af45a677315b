# shellcheck shell=bash
# The job's own model-free checks, run once by the launcher before the queue (the dry run) and
# before srun: the code the job runs at start-up (python -m megatron_ext.trainer.checks), so a
# training flag, a plugin or DeepSpeed key, or a divisibility that the job would refuse stops here
# with the job's own error line instead of after the queue wait, once per rank.
# JOB_CHECKS=0 skips them (the job still runs them at start-up).
# Sourced by common.sh; uses its die/warn and the launcher's NTASKS, TRAIN_PYTHON, REPO_DIR.

# Exits 0 where the checks and what they import (DeepSpeed's config, megatron-core's parser) are there.
_CHECKS_IMPORTABLE='import importlib.util as u, sys, megatron_ext.trainer.checks
sys.exit(any(u.find_spec(m) is None for m in ("torch", "deepspeed", "megatron.core")))'

# The first Python that imports the suite here (TRAIN_PYTHON, the checkout's .venv, python3);
# nothing when none does (e.g. the job's Python lives in a container image).
_checks_python() {
    local py
    for py in "$TRAIN_PYTHON" "$REPO_DIR/.venv/bin/python" python3; do
        if PYTHONPATH="$REPO_DIR${PYTHONPATH:+:$PYTHONPATH}" "$py" -c "$_CHECKS_IMPORTABLE" >/dev/null 2>&1; then
            echo "$py"
            return 0
        fi
    done
}

# check_job_flags MODE FLAG...: MODE `job` checks the suite's main job flags, `upstream` those the
# suite checks of an upstream pretrain_gpt.py (plugin sections, tensor parallelism, DeepSpeed JSON).
check_job_flags() {
    local mode="$1" py rc=0
    shift
    case "${JOB_CHECKS:-1}" in
    1) ;;
    0) return 0 ;;
    *) die "JOB_CHECKS='$JOB_CHECKS' is not understood; use 1 (check the flags here, the default) or 0 (leave them to the job)" ;;
    esac
    py="$(_checks_python)"
    if [[ -z "$py" ]]; then
        [[ "$DRY_RUN" == 1 ]] &&
            warn "the job's own checks did not run: no Python here imports the suite (tried $TRAIN_PYTHON, $REPO_DIR/.venv/bin/python, python3); activate its environment (or set TRAIN_PYTHON) to check the flags before the queue"
        return 0
    fi
    local upstream=()
    [[ "$mode" == upstream ]] && upstream=(--upstream)
    PYTHONPATH="$REPO_DIR${PYTHONPATH:+:$PYTHONPATH}" "$py" -m megatron_ext.trainer.checks \
        --world-size "$NTASKS" "${upstream[@]}" -- "$@" || rc=$?
    ((rc == 0)) && return 0
    ((rc == 2)) && exit 2 # the check printed its one error line
    die "the job's checks stopped with exit code $rc (run: $py -m megatron_ext.trainer.checks --world-size $NTASKS -- FLAGS)"
}

# The sbatch line that submits what this dry run shows: account (a placeholder when ACCOUNT is
# unset on a cluster that charges one), partition, nodes, and the options this run was given.
submit_line() {
    local words=(sbatch)
    if [[ -n "${ACCOUNT:-}" ]]; then
        words+=(-A "$ACCOUNT")
    elif [[ "$PLATFORM" != local ]]; then
        words+=(-A "<ACCOUNT>")
    fi
    [[ -n "${PARTITION:-}" ]] && words+=(-p "$PARTITION")
    words+=(-N "$NODES" "scripts/slurm/${PLATFORM}.sbatch" "${SUBMIT_ARGS[@]}")
    local line
    line="$(printf '%q ' "${words[@]}")"
    echo "${line% }" | sed 's/\\<ACCOUNT\\>/<ACCOUNT>/'
}
