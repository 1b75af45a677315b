# shellcheck shell=bash
# Launcher logic shared by frontier.sbatch, nvidia.sbatch and local.sbatch.
# Sourced, never run. The platform script sets its defaults, sources this file,
# then calls:
#
#   launcher_init "$@"          parse arguments, resolve and check parameters
#   set_env NAME VALUE          export NAME=VALUE and list it in the printout
#   default_env NAME VALUE      same, unless the caller set NAME (kept; empty:
#                               NAME is left out)
#   load_modules MOD...         `module load` each one if `module` exists
#   set_master_addr_port PORT   MASTER_ADDR (first node) and MASTER_PORT
#   launch SRUN_FLAG...         print the environment and the srun line, then
#                               run it (or stop there in dry-run mode)
#
# Platform defaults (set before sourcing): PLATFORM, DEFAULT_MODEL,
# DEFAULT_CONFIG, DEFAULT_TASKS_PER_NODE. See docs/slurm.md for the parameters.

if [[ -z "${REPO_DIR:-}" ]]; then
    REPO_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
fi
SLURM_SCRIPTS_DIR="$REPO_DIR/scripts/slurm"
PRESETS_DIR="$REPO_DIR/scripts/presets"
# shellcheck source=job_checks.sh
source "$SLURM_SCRIPTS_DIR/job_checks.sh"

die() {
    echo "error: $*" >&2
    exit 2
}

warn() {
    echo "warning: $*" >&2
}

usage() {
    local tpn_default="$DEFAULT_TASKS_PER_NODE"
    [[ "${TASKS_PER_NODE_FROM_ALLOCATION:-0}" == 1 ]] && tpn_default="the allocation's, else $DEFAULT_TASKS_PER_NODE"
    cat <<EOF
usage: sbatch [SBATCH OPTIONS] scripts/slurm/${PLATFORM}.sbatch [OPTIONS] [-- TRAINING FLAGS]
       DRY_RUN=1 bash scripts/slurm/${PLATFORM}.sbatch [OPTIONS]

options (each one overrides the environment variable in brackets):
  --dry-run               print the environment and the srun line, launch nothing [DRY_RUN=1]
  --nodes N               number of nodes                      [NODES, default: the allocation, else 1]
  --tasks-per-node N      ranks per node                       [TASKS_PER_NODE, default: ${tpn_default}]
  --model NAME            preset scripts/presets/NAME.args     [MODEL, default: ${DEFAULT_MODEL}]
  --config FILE           DeepSpeed JSON (path or preset name) [CONFIG, default: ${DEFAULT_CONFIG}]
  --data-path PREFIX      indexed dataset PREFIX.bin/.idx      [DATA_PATH, default: a generated small corpus]
  --checkpoint-dir DIR    --save/--load directory              [CHECKPOINT_DIR, default: none]
  --job NAME              train, or zero-ab: the probe, then the ZeRO A/B command with its
                          profile, results in AB_DIR           [JOB, default: train]
  -h, --help              this text
environment only: ACCOUNT, PARTITION (shown in the dry run's sbatch line, repeated to srun),
  CONTAINER_IMAGE (pyxis) or APPTAINER_IMAGE, CONTAINER_MOUNTS (extra binds, comma-separated)
Anything else (and everything after --) is appended to the training flags,
after the preset and EXTRA_ARGS, so it overrides them.
UPSTREAM_DIR=<Megatron-LM or Megatron-DeepSpeed checkout> runs its pretrain_gpt.py through
python -m megatron_ext.launch instead of the suite's main job (docs/slurm.md, "Upstream scripts").
Presets: $(list_presets)
EOF
}

list_presets() {
    local f names=()
    for f in "$PRESETS_DIR"/*.args; do
        [[ -f "$f" ]] && names+=("$(basename "$f" .args)")
    done
    echo "${names[*]:-none}"
}

# ---------------------------------------------------------------- environment
ENV_NAMES=()

_remember_env() {
    local n
    for n in "${ENV_NAMES[@]}"; do
        [[ "$n" == "$1" ]] && return 0
    done
    ENV_NAMES+=("$1")
}

set_env() {
    export "$1=$2"
    _remember_env "$1"
}

# Set by the caller wins; set to an empty value by the caller: left out.
default_env() {
    if [[ -z "${!1+x}" ]]; then
        export "$1=$2"
    elif [[ -z "${!1}" ]]; then
        unset "$1"
        return 0
    else
        export "${1?}"
    fi
    _remember_env "$1"
}

# Prepend a directory to a PATH-like variable (no duplicate, no empty entry).
prepend_path() {
    local name="$1" dir="$2" cur="${!1:-}"
    case ":$cur:" in
    *":$dir:"*) set_env "$name" "$cur" ;;
    *) set_env "$name" "$dir${cur:+:$cur}" ;;
    esac
}

MODULE_LINES=()

load_modules() {
    local m
    for m in "$@"; do
        MODULE_LINES+=("module load $m")
    done
    if [[ "$DRY_RUN" == 1 ]]; then
        return 0
    fi
    if ! type module >/dev/null 2>&1; then
        warn "'module' is not available here; not loading: $* (set up the environment yourself, e.g. with ENV_SCRIPT)"
        return 0
    fi
    for m in "$@"; do
        module load "$m" || die "'module load $m' failed; set MODULES to the module names of this system"
    done
}

# ---------------------------------------------------------------- parameters
is_pos_int() {
    [[ "$1" =~ ^[1-9][0-9]*$ ]]
}

_need_value() {
    [[ $# -ge 2 && -n "$2" ]] || die "option $1 needs a value"
}

launcher_init() {
    CLI_ARGS=()
    # This run's options but --dry-run and --nodes (sbatch -N sets the allocation): what the dry
    # run's submit line passes on.
    SUBMIT_ARGS=()
    local i=1 arg
    while ((i <= $#)); do
        arg="${!i}"
        if [[ "$arg" == -- ]]; then
            SUBMIT_ARGS+=("${@:i}")
            break
        elif [[ "$arg" == --nodes ]]; then
            ((i += 1))
        elif [[ "$arg" != --dry-run && "$arg" != --nodes=* ]]; then
            SUBMIT_ARGS+=("$arg")
        fi
        ((i += 1))
    done
    while [[ $# -gt 0 ]]; do
        arg="$1"
        case "$arg" in
        --dry-run) DRY_RUN=1 ;;
        -h | --help)
            usage
            exit 0
            ;;
        --nodes | --tasks-per-node | --model | --config | --data-path | --checkpoint-dir | --job)
            _need_value "$@"
            case "$arg" in
            --job) JOB="$2" ;;
            --nodes) NODES="$2" ;;
            --tasks-per-node) TASKS_PER_NODE="$2" ;;
            --model) MODEL="$2" ;;
            --config) CONFIG="$2" ;;
            --data-path) DATA_PATH="$2" ;;
            --checkpoint-dir) CHECKPOINT_DIR="$2" ;;
            esac
            shift
            ;;
        --nodes=* | --tasks-per-node=* | --model=* | --config=* | --data-path=* | --checkpoint-dir=* | --job=*)
            local key="${arg%%=*}" val="${arg#*=}"
            _need_value "$key" "$val"
            case "$key" in
            --job) JOB="$val" ;;
            --nodes) NODES="$val" ;;
            --tasks-per-node) TASKS_PER_NODE="$val" ;;
            --model) MODEL="$val" ;;
            --config) CONFIG="$val" ;;
            --data-path) DATA_PATH="$val" ;;
            --checkpoint-dir) CHECKPOINT_DIR="$val" ;;
            esac
            ;;
        --)
            shift
            CLI_ARGS+=("$@")
            break
            ;;
        *) CLI_ARGS+=("$arg") ;;
        esac
        shift
    done

    DRY_RUN="${DRY_RUN:-0}"
    case "$DRY_RUN" in
    1 | true | yes) DRY_RUN=1 ;;
    0 | false | no | "") DRY_RUN=0 ;;
    *) die "DRY_RUN='$DRY_RUN' is not understood; use DRY_RUN=1 (print only) or DRY_RUN=0 (launch)" ;;
    esac

    JOB="${JOB:-train}"
    case "$JOB" in
    train) ;;
    zero-ab)
        [[ -z "${UPSTREAM_DIR:-}" ]] || die "JOB=zero-ab runs the suite's probe and A/B command, not an upstream script: unset UPSTREAM_DIR"
        AB_DIR="${AB_DIR:-$PWD/zero-ab-${SLURM_JOB_ID:-local}}"
        ;;
    *) die "JOB='$JOB' is not a job of these scripts; use train (the default) or zero-ab" ;;
    esac

    _resolve_nodes
    _resolve_upstream
    _resolve_model
    _resolve_config
    _resolve_python
    _resolve_container
    _check_data_path
    # ACCOUNT / PARTITION: charged by the allocation when submitted with them (sbatch -A / -p, or the
    # dry run's "submit" line); an srun inside that allocation repeats them.
    SRUN_ACCOUNT=()
    [[ -n "${ACCOUNT:-}" ]] && SRUN_ACCOUNT+=(--account="$ACCOUNT")
    [[ -n "${PARTITION:-}" ]] && SRUN_ACCOUNT+=(--partition="$PARTITION")
    return 0
}

# UPSTREAM_DIR: run that checkout's pretrain_gpt.py through the suite's launcher. Its presets are
# scripts/presets/upstream/<kind>-<platform>.args/.json where they exist; the JSON goes to DeepSpeed's own
# --deepspeed_config on Megatron-DeepSpeed and to the suite's --deepspeed-config on Megatron-LM.
UPSTREAM_KIND=""
CONFIG_FLAG=--deepspeed-config
_resolve_upstream() {
    [[ -n "${UPSTREAM_DIR:-}" ]] || return 0
    [[ -f "$UPSTREAM_DIR/pretrain_gpt.py" ]] ||
        die "UPSTREAM_DIR='$UPSTREAM_DIR' holds no pretrain_gpt.py; point it at the root of a Megatron-LM or Megatron-DeepSpeed checkout"
    UPSTREAM_DIR="$(cd "$UPSTREAM_DIR" && pwd)"
    if [[ -f "$UPSTREAM_DIR/megatron/training/initialize.py" ]]; then
        UPSTREAM_KIND=megatron-lm
    elif [[ -f "$UPSTREAM_DIR/megatron/training.py" ]]; then
        UPSTREAM_KIND=megatron-deepspeed
        CONFIG_FLAG=--deepspeed_config
    else
        die "UPSTREAM_DIR='$UPSTREAM_DIR' is neither Megatron-LM (megatron/training/initialize.py) nor Megatron-DeepSpeed (megatron/training.py)"
    fi
    DEFAULT_MODEL="upstream/$UPSTREAM_KIND-$PLATFORM"
    [[ -n "${MODEL:-}" || -f "$PRESETS_DIR/$DEFAULT_MODEL.args" ]] ||
        die "no preset scripts/presets/$DEFAULT_MODEL.args for upstream $UPSTREAM_KIND on $PLATFORM; set MODEL to an .args file with the upstream flags"
    DEFAULT_CONFIG=""
    if [[ -f "$PRESETS_DIR/$DEFAULT_MODEL.json" ]]; then
        DEFAULT_CONFIG="$DEFAULT_MODEL.json"
    fi
    [[ -n "${DATA_PATH:-}" ]] ||
        die "upstream pretrain_gpt.py needs a corpus: set DATA_PATH to the prefix written by the checkout's tools/preprocess_data.py"
    return 0
}

_resolve_nodes() {
    local alloc="${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-}}"
    NODES="${NODES:-${alloc:-1}}"
    is_pos_int "$NODES" ||
        die "NODES='$NODES' is not a positive integer; set the node count, e.g. NODES=2 (or sbatch -N 2)"
    if [[ -n "$alloc" ]] && ((NODES > alloc)); then
        die "NODES=$NODES but this allocation has $alloc node(s); submit with 'sbatch -N $NODES' or lower NODES"
    fi
    local alloc_tpn="${SLURM_NTASKS_PER_NODE:-}"
    if [[ -z "$alloc_tpn" && -n "${SLURM_NTASKS:-}" && -n "$alloc" ]] && ((SLURM_NTASKS % alloc == 0)); then
        alloc_tpn=$((SLURM_NTASKS / alloc))
    fi
    if [[ -z "${TASKS_PER_NODE:-}" ]]; then
        if [[ "${TASKS_PER_NODE_FROM_ALLOCATION:-0}" == 1 && -n "$alloc_tpn" ]]; then
            TASKS_PER_NODE="$alloc_tpn"
        else
            TASKS_PER_NODE="$DEFAULT_TASKS_PER_NODE"
        fi
    fi
    is_pos_int "$TASKS_PER_NODE" ||
        die "TASKS_PER_NODE='$TASKS_PER_NODE' is not a positive integer; set the ranks per node, e.g. TASKS_PER_NODE=8"
    NTASKS=$((NODES * TASKS_PER_NODE))
}

_resolve_model() {
    MODEL="${MODEL:-$DEFAULT_MODEL}"
    [[ -n "$MODEL" ]] || die "MODEL is empty; set MODEL to a preset name ($(list_presets))"
    if [[ -f "$MODEL" ]]; then
        MODEL_FILE="$MODEL"
    elif [[ -f "$PRESETS_DIR/$MODEL.args" ]]; then
        MODEL_FILE="$PRESETS_DIR/$MODEL.args"
    elif [[ -f "$PRESETS_DIR/$MODEL" && "$MODEL" == *.args ]]; then
        MODEL_FILE="$PRESETS_DIR/$MODEL"
    else
        die "unknown model preset MODEL='$MODEL'; use one of: $(list_presets) (files scripts/presets/<name>.args) or the path of an .args file"
    fi
    MODEL_ARGS=()
    local line
    while IFS= read -r line || [[ -n "$line" ]]; do
        line="${line%%#*}"
        # shellcheck disable=SC2206 # presets are whitespace-separated flags
        MODEL_ARGS+=($line)
    done <"$MODEL_FILE"
    ((${#MODEL_ARGS[@]} > 0)) || die "model preset $MODEL_FILE holds no flags"
}

_resolve_config() {
    CONFIG="${CONFIG:-$DEFAULT_CONFIG}"
    CONFIG_FILE=""
    if [[ -z "$CONFIG" && "$UPSTREAM_KIND" == megatron-lm ]]; then
        return 0 # Megatron-LM trains without DeepSpeed: the plugin flags alone are enough
    fi
    [[ -n "$CONFIG" ]] || die "CONFIG is empty; set CONFIG to a DeepSpeed JSON file"
    local c
    for c in "$CONFIG" "$PRESETS_DIR/$CONFIG" "$PRESETS_DIR/$CONFIG.json"; do
        if [[ -f "$c" ]]; then
            CONFIG_FILE="$(cd "$(dirname "$c")" && pwd)/$(basename "$c")"
            break
        fi
    done
    [[ -n "${CONFIG_FILE:-}" ]] ||
        die "DeepSpeed config CONFIG='$CONFIG' not found (looked in the current directory and scripts/presets/); set CONFIG to an existing JSON file"
    if command -v python3 >/dev/null 2>&1; then
        local err
        if ! err="$(python3 -c 'import json, sys; json.load(open(sys.argv[1]))' "$CONFIG_FILE" 2>&1)"; then
            die "DeepSpeed config $CONFIG_FILE is not valid JSON: ${err##*$'\n'}"
        fi
    fi
}

_resolve_python() {
    if [[ -n "${ENV_SCRIPT:-}" && "$DRY_RUN" != 1 ]]; then
        [[ -f "$ENV_SCRIPT" ]] || die "ENV_SCRIPT='$ENV_SCRIPT' does not exist; point it at a file to source (e.g. one activating your Python environment)"
        # shellcheck disable=SC1090
        source "$ENV_SCRIPT"
    fi
    if [[ -z "${TRAIN_PYTHON:-}" ]]; then
        if [[ -x "$REPO_DIR/.venv/bin/python" ]]; then
            TRAIN_PYTHON="$REPO_DIR/.venv/bin/python"
        else
            TRAIN_PYTHON=python3
        fi
    fi
    if [[ -n "$UPSTREAM_KIND" ]]; then
        TRAIN_SCRIPT="$UPSTREAM_DIR/pretrain_gpt.py"
        TRAIN_PROGRAM=(-m megatron_ext.launch "$TRAIN_SCRIPT")
        prepend_path PYTHONPATH "$REPO_DIR" # the launcher and hooks, also where the suite is not installed
    else
        TRAIN_SCRIPT="${TRAIN_SCRIPT:-$REPO_DIR/scripts/pretrain_gpt.py}"
        TRAIN_PROGRAM=("$TRAIN_SCRIPT")
    fi
}

_check_data_path() {
    [[ -n "${DATA_PATH:-}" ]] || return 0
    local p="$DATA_PATH"
    if [[ ! -e "$p.bin" || ! -e "$p.idx" ]]; then
        warn "DATA_PATH=$p: $p.bin and $p.idx not both found here; fine only if they exist on the compute nodes"
    fi
    return 0
}

# Value of a flag in the final training flags (last one wins), or $2.
flag_value() {
    local name="$1" val="$2" i
    local all=("${MODEL_ARGS[@]}" "${EXTRA_ARR[@]}" "${CLI_ARGS[@]}")
    for ((i = 0; i < ${#all[@]}; i++)); do
        if [[ "${all[$i]}" == "$name" && $((i + 1)) -lt ${#all[@]} ]]; then
            val="${all[$((i + 1))]}"
        elif [[ "${all[$i]}" == "$name="* ]]; then
            val="${all[$i]#*=}"
        fi
    done
    echo "$val"
}

# ---------------------------------------------------------------- rendezvous
first_node() {
    if [[ -n "${SLURM_JOB_NODELIST:-}" ]] && command -v scontrol >/dev/null 2>&1; then
        local first
        first="$(scontrol show hostnames "$SLURM_JOB_NODELIST" 2>/dev/null | head -n1 || true)"
        [[ -n "$first" ]] ||
            die "cannot expand SLURM_JOB_NODELIST='$SLURM_JOB_NODELIST' with scontrol; set MASTER_ADDR to the first node's address"
        echo "$first"
    else
        hostname -s 2>/dev/null || hostname
    fi
}

# IP of the first node: `hostname -i` when we run on it (the batch script
# runs on the first node of its allocation), else a name lookup.
set_master_addr_port() {
    local default_port="$1"
    if [[ -z "${MASTER_ADDR:-}" ]]; then
        local node me addr=""
        node="$(first_node)"
        me="$(hostname -s 2>/dev/null || hostname)"
        if [[ "$node" == "$me" || "$node" == "$(hostname)" ]]; then
            addr="$(hostname -i 2>/dev/null | awk '{print $1}' || true)"
        else
            addr="$(getent hosts "$node" 2>/dev/null | awk 'NR==1 {print $1}' || true)"
        fi
        MASTER_ADDR="${addr:-$node}"
    fi
    set_env MASTER_ADDR "$MASTER_ADDR"
    default_env MASTER_PORT "$default_port"
    if ! is_pos_int "$MASTER_PORT" || ((MASTER_PORT > 65535)); then
        die "MASTER_PORT='$MASTER_PORT' is not a TCP port number (1-65535)"
    fi
}

# ---------------------------------------------------------------- containers
# CONTAINER_IMAGE: Slurm's pyxis plugin starts every rank in that image (srun --container-image), the
# checkout mounted at the same path (plus CONTAINER_MOUNTS). APPTAINER_IMAGE: each rank runs under
# `apptainer exec` with the GPUs (--rocm on Frontier, --nv on NVIDIA) and the checkout bound.
CONTAINER_SRUN=()
CONTAINER_EXEC=()
_resolve_container() {
    if [[ -n "${CONTAINER_IMAGE:-}" && -n "${APPTAINER_IMAGE:-}" ]]; then
        die "CONTAINER_IMAGE (pyxis) and APPTAINER_IMAGE are both set: choose one container runtime"
    fi
    if [[ -n "${CONTAINER_IMAGE:-}" ]]; then
        CONTAINER_SRUN=(--container-image="$CONTAINER_IMAGE"
            --container-mounts="$REPO_DIR:$REPO_DIR${CONTAINER_MOUNTS:+,$CONTAINER_MOUNTS}"
            --container-workdir="$PWD")
    elif [[ -n "${APPTAINER_IMAGE:-}" ]]; then
        local gpu=--nv
        [[ "$PLATFORM" == frontier ]] && gpu=--rocm
        [[ "$PLATFORM" == local ]] && gpu=""
        CONTAINER_EXEC=(apptainer exec ${gpu:+"$gpu"} --bind "$REPO_DIR${CONTAINER_MOUNTS:+,$CONTAINER_MOUNTS}" "$APPTAINER_IMAGE")
    fi
}

# ---------------------------------------------------------------- launch
print_plan() {
    local n
    echo "# platform: $PLATFORM  nodes: $NODES  tasks/node: $TASKS_PER_NODE  tasks: $NTASKS"
    echo "# account: ${ACCOUNT:-(from the allocation)}  partition: ${PARTITION:-(from the allocation)}"
    echo "# submit: $(submit_line)"
    if [[ -n "${CONTAINER_IMAGE:-}" ]]; then
        echo "# container (pyxis): $CONTAINER_IMAGE"
    elif [[ -n "${APPTAINER_IMAGE:-}" ]]; then
        echo "# container (apptainer): $APPTAINER_IMAGE"
    else
        echo "# container: none"
    fi
    [[ -n "$UPSTREAM_KIND" ]] && echo "# upstream $UPSTREAM_KIND: $TRAIN_SCRIPT (through megatron_ext.launch)"
    echo "# model preset: $MODEL_FILE"
    echo "# deepspeed config: ${CONFIG_FILE:-none}"
    if ((${#MODULE_LINES[@]} > 0)); then
        echo "# modules"
        printf '%s\n' "${MODULE_LINES[@]}"
    fi
    echo "# environment"
    for n in "${ENV_NAMES[@]}"; do
        printf 'export %s=%q\n' "$n" "${!n}"
    done
    # shellcheck disable=SC2016 # printed literally: each rank expands it
    local lr='$SLURM_LOCALID'
    [[ "${LAUNCH_LOCAL_RANK:-slurm}" == zero ]] && lr=0
    echo "# per rank, set by rank_env.sh (SLURM_PROCID/SLURM_LOCALID/SLURM_NODEID stay as srun sets them)"
    echo "#   RANK=\$SLURM_PROCID WORLD_SIZE=\$SLURM_NTASKS LOCAL_RANK=$lr LOCAL_WORLD_SIZE=\$SLURM_NTASKS_PER_NODE"
    if [[ "$JOB" == zero-ab ]]; then
        echo "# results: $AB_DIR (profile.json, ab.json, ab.png)"
        echo "# command 1: the probe"
        printf '%q ' "${PROBE_CMD[@]}" | sed 's/ $//'
        echo
    fi
    echo "# command"
    printf '%q ' "${LAUNCH_CMD[@]}" | sed 's/ $//'
    echo
}

# Dry run: print the plan and succeed (the caller returns). Else check that srun and an allocation
# exist and fail (the caller goes on to launch).
_dry_run_done() {
    if [[ "$DRY_RUN" == 1 ]]; then
        echo "# DRY RUN: nothing is launched"
        print_plan
        if [[ -z "${DATA_PATH:-}" && "$JOB" == train ]]; then
            warn "no DATA_PATH: the job would train on a small generated corpus; set DATA_PATH=<prefix of your .bin/.idx> (or --data-path)"
        fi
        return 0
    fi
    command -v srun >/dev/null 2>&1 ||
        die "srun not found; run this inside a Slurm allocation (sbatch/salloc) or use DRY_RUN=1 to only print the plan"
    [[ -n "${SLURM_JOB_ID:-}" ]] ||
        die "not inside a Slurm allocation (SLURM_JOB_ID unset); submit with sbatch, or use DRY_RUN=1 to only print the plan"
    return 1
}

launch() {
    # shellcheck disable=SC2206 # EXTRA_ARGS is a whitespace-separated flag string
    EXTRA_ARR=(${EXTRA_ARGS:-})

    if [[ "$JOB" == zero-ab ]]; then
        _launch_zero_ab "$@"
        return
    fi
    local tp
    tp="$(flag_value --tensor-model-parallel-size 1)"
    is_pos_int "$tp" || die "--tensor-model-parallel-size '$tp' is not a positive integer"
    ((NTASKS % tp == 0)) ||
        die "$NTASKS tasks cannot be split into tensor-parallel groups of $tp; change NODES/TASKS_PER_NODE or --tensor-model-parallel-size"

    local train=("${MODEL_ARGS[@]}")
    [[ -n "$CONFIG_FILE" ]] && train+=("$CONFIG_FLAG" "$CONFIG_FILE")
    [[ -n "${DATA_PATH:-}" ]] && train+=(--data-path "$DATA_PATH")
    [[ -n "${CHECKPOINT_DIR:-}" ]] && train+=(--save "$CHECKPOINT_DIR" --load "$CHECKPOINT_DIR")
    train+=("${EXTRA_ARR[@]}" "${CLI_ARGS[@]}")

    # Block distribution: consecutive ranks fill a node first, the layout the
    # topology (node-local groups) expects.
    LAUNCH_CMD=(srun "$@" --distribution=block "${SRUN_ACCOUNT[@]}" "${CONTAINER_SRUN[@]}")
    # shellcheck disable=SC2206 # SRUN_ARGS is a whitespace-separated flag string
    LAUNCH_CMD+=(${SRUN_ARGS:-})
    LAUNCH_CMD+=("${CONTAINER_EXEC[@]}" "$SLURM_SCRIPTS_DIR/rank_env.sh" "$TRAIN_PYTHON" -u "${TRAIN_PROGRAM[@]}" "${train[@]}")

    check_job_flags "$([[ -n "$UPSTREAM_KIND" ]] && echo upstream || echo job)" "${train[@]}"
    _dry_run_done && return 0
    [[ -f "$TRAIN_SCRIPT" ]] ||
        die "training script $TRAIN_SCRIPT not found; check the checkout or set TRAIN_SCRIPT"
    [[ -n "${CHECKPOINT_DIR:-}" ]] && mkdir -p "$CHECKPOINT_DIR"
    print_plan
    echo "# start: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    local rc=0
    "${LAUNCH_CMD[@]}" || rc=$?
    echo "# end: $(date -u +%Y-%m-%dT%H:%M:%SZ) exit code $rc"
    return "$rc"
}

# JOB=zero-ab: hierarchical ZeRO's probe (a profile of this allocation's collectives), then the A/B
# command (stock ZeRO-3, hpZ, ZeRO++, ours with that profile) on the preset's shape and the config's
# buckets. Extra arguments go to the A/B command (e.g. --steps 10).
_launch_zero_ab() {
    local srun_cmd=(srun "$@" --distribution=block "${SRUN_ACCOUNT[@]}" "${CONTAINER_SRUN[@]}")
    # shellcheck disable=SC2206 # SRUN_ARGS is a whitespace-separated flag string
    srun_cmd+=(${SRUN_ARGS:-})
    srun_cmd+=("${CONTAINER_EXEC[@]}" "$SLURM_SCRIPTS_DIR/rank_env.sh" "$TRAIN_PYTHON" -u -m)
    local config=()
    [[ -n "$CONFIG_FILE" ]] && config=(--deepspeed-config "$CONFIG_FILE")
    PROBE_CMD=("${srun_cmd[@]}" deepspeed_ext.zero.probe --out "$AB_DIR/profile.json" "${config[@]}")
    LAUNCH_CMD=("${srun_cmd[@]}" deepspeed_ext.zero.bench "${config[@]}" --megatron-args "$MODEL_FILE"
        --profile "$AB_DIR/profile.json" --json "$AB_DIR/ab.json" --plot "$AB_DIR/ab.png" "${CLI_ARGS[@]}")
    prepend_path PYTHONPATH "$REPO_DIR" # the plugins, also where the suite is not installed
    [[ -n "$CONFIG_FILE" ]] && check_job_flags upstream --deepspeed_config "$CONFIG_FILE"
    _dry_run_done && return 0
    mkdir -p "$AB_DIR"
    print_plan
    echo "# start: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    local rc=0
    "${PROBE_CMD[@]}" || rc=$?
    ((rc == 0)) && { "${LAUNCH_CMD[@]}" || rc=$?; }
    echo "# end: $(date -u +%Y-%m-%dT%H:%M:%SZ) exit code $rc"
    return "$rc"
}
