"""The planner's --emit (planner/launch.py): complete launches of the best plan.

Each form's trainer argv goes through the entry point's own checks (`parse_args` and
`config_from_args`, which an emitted flag the trainer refuses fails) and its launcher
words through torchrun's parser; the scripts are run by bash with torchrun, srun and
scontrol replaced by stubs that record what they get, so bash's own expansion and quoting
is what is checked. Bad input is one line naming the flag. The torchrun and sbatch forms
then train a tiny GPT here: two "nodes" of one process each on this machine, which is the
multi-node path (c10d rendezvous, one node hosting it) on one box.
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_2bw.planner.cli import main as cli_main
from tests.dist_harness import free_port
from tests.entry_harness import ROOT

SMALL = ["--num-layers", "8", "--hidden-size", "512", "--num-attention-heads", "8",
         "--seq-length", "128", "--vocab-size", "1024", "--global-batch-size", "32"]
DATA = ["--data-path", "/fsx/data/owt_text_document", "--vocab-file", "/fsx/data/gpt2-vocab.json",
        "--merge-file", "/fsx/data/gpt2-merges.txt", "--split", "949,50,1"]
LENGTH = ["--train-iters", "1000", "--lr", "1.5e-4", "--min-lr", "1e-5", "--lr-decay-style",
          "cosine", "--lr-warmup-fraction", "0.01"]
CKPT = ["--save", "/fsx/ckpt/run1", "--save-interval", "100"]
CPU_HARDWARE = {"name": "cpu-box", "devices_per_node": 1, "memory_per_device_gb": 8,
                "achieved_tflops": 0.03, "intra_node_bandwidth_gb_s": 1,
                "inter_node_bandwidth_gbit_s": 8, "launch": {"gpus": False}}

RECORDER = '#!/bin/bash\nprintf "%s\\0" "$@" > "$RECORD"\n'  # as python
SCONTROL = """#!/bin/bash
case "$1 $2" in
  "show hostnames") echo node-a; echo node-b ;;
  "show node") echo "NodeName=$3 Arch=x86_64 CoresPerSocket=1"
               echo "   NodeAddr=127.0.0.1 NodeHostName=$3 Version=23.11" ;;
esac
"""
# as srun with one task per node: the command once per node, with srun's task variables
SRUN = """#!/bin/bash
while [[ "$1" == -* ]]; do
  case "$1" in --nodes|--ntasks|--ntasks-per-node) shift 2 ;; *) shift ;; esac
done
pids=()
for ((i = 0; i < SLURM_NNODES; i++)); do
  SLURM_PROCID=$i SLURM_NODEID=$i SLURM_LOCALID=0 SLURM_STEP_NUM_TASKS=$SLURM_NNODES "$@" &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
exit $rc
"""


def planner(argv: list[str], capsys) -> tuple[int, str, str]:
    code = cli_main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def stubs(tmp_path: Path) -> Path:
    """A folder with the recorder (as python), scontrol and srun."""
    folder = tmp_path / "bin"
    folder.mkdir(exist_ok=True)
    for name, text in (("recorder", RECORDER), ("scontrol", SCONTROL), ("srun", SRUN)):
        (folder / name).write_text(text)
        (folder / name).chmod(0o755)
    return folder


def slurm_env(folder: Path, nodes: int, **extra: str) -> dict:
    return dict(os.environ, PATH=f"{folder}:{os.environ['PATH']}", SLURM_JOB_ID="4242",
                SLURM_JOB_NODELIST="node-[a-b]", SLURM_NNODES=str(nodes), **extra)


def launched_words(form: str, text: str, tmp_path: Path, nodes: int) -> list[str]:
    """What torchrun would be started with: split from the line, or recorded from bash
    running the script."""
    if form == "command":
        words = shlex.split(text)
        return words[words.index("torchrun") + 1:]
    script, record = tmp_path / f"{form}.sh", tmp_path / "argv"
    script.write_text(text)
    folder = stubs(tmp_path)
    # python is the recorder here, so the sbatch form cannot ask it for a free port
    port = {"MASTER_PORT": "14242"} if form == "sbatch" else {}
    env = slurm_env(folder, nodes, PYTHON=str(folder / "recorder"), RECORD=str(record),
                    MASTER_ADDR="10.0.0.5", **port)
    subprocess.run(["bash", str(script)], env=env, check=True, timeout=30)
    words = record.read_bytes().decode().split("\0")[:-1]
    assert words[:2] == ["-m", "torch.distributed.run"]
    return words[2:]


def trainer_args(words: list[str], model: str = "gpt"):
    """torchrun's parser on the launcher words; the entry point's parser and checks on the
    rest (UserError when it would exit 2)."""
    from torch.distributed.run import get_args_parser

    from megatron_2bw.training import arguments
    launcher = get_args_parser().parse_args(words)
    assert launcher.training_script == f"pretrain_{model}.py"
    world = int(launcher.nnodes.split(":")[0]) * int(launcher.nproc_per_node)
    args = arguments.parse_args(model, launcher.training_script_args)
    arguments.config_from_args(args, model, world_size=world, vocab_size=args.vocab_size)
    return launcher, args


@pytest.mark.parametrize("form, gpus, hardware", [
    ("command", 8, "p4d.24xlarge"), ("command", 16, "p5.48xlarge"),
    ("torchrun", 16, "p4d.24xlarge"), ("torchrun", 8, "p3.16xlarge"),
    ("sbatch", 16, "p5.48xlarge"), ("sbatch", 8, "p3.16xlarge")])
def test_each_form_is_a_launch_the_trainer_and_torchrun_accept(form, gpus, hardware, tmp_path,
                                                               capsys):
    plan = tmp_path / "plan.json"
    argv = (SMALL + ["--num-gpus", str(gpus), "--hardware", hardware, "--json", str(plan),
                     "--emit", form, "--master-addr", "10.0.0.5", "--bf16"] + DATA + LENGTH
            + CKPT + ["--", "--hidden-dropout", "0.05", "--log-throughput"])
    code, text, err = planner(argv, capsys)
    assert code == 0, err
    nodes = gpus // 8
    launcher, args = trainer_args(launched_words(form, text, tmp_path, nodes))
    best = json.loads(plan.read_text())["best"]
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
            args.pipeline_schedule, args.micro_batch_size, args.global_batch_size) == (
        best["tensor_parallel"], best["pipeline_depth"], best["schedule"],
        best["micro_batch_size"], 32)
    assert launcher.nnodes.split(":")[0] == str(nodes) and launcher.nproc_per_node == "8"
    if nodes > 1:
        expected = "4242" if form == "sbatch" else "megatron-2bw"
        assert (launcher.rdzv_backend, launcher.rdzv_endpoint, launcher.rdzv_id) == (
            "c10d", "127.0.0.1:14242" if form == "sbatch" else "10.0.0.5:29500", expected)
    else:
        assert launcher.standalone or form != "command"
    assert args.data_path == ["/fsx/data/owt_text_document"] and args.lr == 1.5e-4
    assert (args.train_iters, args.lr_decay_style, args.split) == (1000, "cosine", "949,50,1")
    assert args.save == args.load == "/fsx/ckpt/run1" and args.exit_signal_handler
    assert args.bf16 and not args.fp16 and args.hidden_dropout == 0.05 and args.log_throughput
    efa = "FI_PROVIDER=efa" in text and "FI_EFA_USE_DEVICE_RDMA=1" in text
    assert efa == (hardware != "p3.16xlarge" and (form != "command" or nodes > 1))
    if form != "command":
        subprocess.run(["bash", "-n", str(tmp_path / f"{form}.sh")], check=True)


def test_sbatch_directives_follow_the_plan_and_the_hardware(tmp_path, capsys):
    hw = tmp_path / "cpu.json"
    hw.write_text(json.dumps(CPU_HARDWARE))
    for hardware, gpus_line in (("p4d.24xlarge", "#SBATCH --gpus-per-node=8"), (str(hw), None)):
        code, text, err = planner(SMALL + ["--num-gpus", "16", "--hardware", hardware, "--emit",
                                           "sbatch", "--partition", "train", "--time", "2:00:00"]
                                  + DATA + LENGTH + CKPT, capsys)
        assert code == 0, err
        directives = [ln for ln in text.splitlines() if ln.startswith("#SBATCH")]
        expected = {f"#SBATCH --nodes={2 if gpus_line else 16}", "#SBATCH --ntasks-per-node=1",
                    "#SBATCH --exclusive", "#SBATCH --time=2:00:00", "#SBATCH --signal=TERM@120",
                    "#SBATCH --partition=train", "#SBATCH --job-name=megatron-2bw"}
        assert expected <= set(directives)
        assert (gpus_line in directives) if gpus_line else not any("gpus" in d for d in directives)
        assert "--shutdown-timeout 120" in text and 'scontrol show hostnames' in text


def test_sbatch_handles_sigterm_as_the_slurm_example_does(capsys):
    """The emitted job and examples/slurm/pretrain_gpt_2bw.sbatch launch torchrun alike:
    SIGTERM ignored through exec (the training's handler takes it), torchrun told not to
    handle it, the same shutdown time, a log appended to on requeue."""
    example = (Path(ROOT) / "examples" / "slurm" / "pretrain_gpt_2bw.sbatch").read_text()
    code, text, err = planner(SMALL + ["--num-gpus", "16", "--hardware", "p4d.24xlarge",
                                       "--emit", "sbatch"] + DATA + LENGTH + CKPT, capsys)
    assert code == 0, err
    ignore = next(ln.strip() for ln in example.splitlines()
                  if ln.strip().startswith("IGNORE_TERM=("))
    assert ignore in text.splitlines()
    for words in ('"${IGNORE_TERM[@]}" "$PY" -m torch.distributed.run', "--kill-on-bad-exit=1",
                  "--signals-to-handle SIGINT,SIGHUP,SIGQUIT", "--shutdown-timeout 120",
                  "#SBATCH --signal=TERM@120", "#SBATCH --requeue", "#SBATCH --open-mode=append",
                  "| sed -n 1p"):
        assert words in example and words in text, words
    code_lines = [ln for t in (example, text) for ln in t.splitlines()
                  if not ln.lstrip().startswith("#")]
    assert not [ln for ln in code_lines if "| head" in ln]  # SIGPIPE under pipefail


def test_sbatch_refuses_an_allocation_of_another_size(tmp_path, capsys):
    code, text, err = planner(SMALL + ["--num-gpus", "16", "--hardware", "p4d.24xlarge",
                                       "--emit", "sbatch"] + DATA + LENGTH + CKPT, capsys)
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    proc = subprocess.run(["bash", str(script)], env=slurm_env(stubs(tmp_path), 3),
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "the plan is for 2 node(s), this job has 3" in proc.stderr


def test_default_time_is_the_predicted_run_time_with_room(capsys):
    from megatron_2bw.planner.launch import default_time, slurm_time
    assert slurm_time(59) == "00:01:00" and slurm_time(3600 * 30 + 1) == "1-06:01:00"
    assert default_time(1.0, 1000) == slurm_time(1250 + 900)


@pytest.mark.parametrize("change, flag", [
    (["--emit", "command", "--lr", "1e-4"] + DATA, "--train-iters"),
    (["--emit", "command", "--train-iters", "10", "--train-samples", "10", "--lr", "1"] + DATA,
     "--train-iters"),
    (["--emit", "command", "--train-iters", "10"] + DATA, "--lr"),
    (["--emit", "command", "--train-iters", "10", "--lr", "1"], "--data-path"),
    (["--emit", "command", "--train-iters", "10", "--lr", "1", "--data-path", "x"], "--vocab-file"),
    (["--emit", "command", "--train-iters", "10", "--lr", "1", "--num-gpus", "16"] + DATA,
     "--master-addr"),
    (["--emit", "sbatch", "--train-iters", "10", "--lr", "1"] + DATA, "--save"),
    (["--emit", "torchrun", "--lr", "x"], "--lr"),
    (DATA, "--data-path"),
    (["--bf16"], "--bf16"),
    (["--", "--hidden-dropout", "0"], "--hidden-dropout"),
    (["--emit", "script"], "--emit"),
    (["--emit", "command", "--train-iters", "10", "--lr", "1"] + DATA
     + ["--", "--use-distributed-optimizer"], "--distributed-optimizer on"),
    (["--emit", "command", "--train-iters", "10", "--lr", "1"] + DATA
     + ["--", "--context-parallel-size", "2"], "--context-parallel-sizes"),
    (["--emit", "command", "--train-iters", "10", "--lr", "1"] + DATA
     + ["--", "--sequence-parallel"], "--no-sequence-parallel"),
])
def test_bad_launch_input_is_one_line_naming_the_flag(change, flag, capsys):
    gpus = [] if "--num-gpus" in change else ["--num-gpus", "8"]
    code, out, err = planner(SMALL + ["--hardware", "p4d.24xlarge"] + gpus + change, capsys)
    assert code == 2 and not out and err.count("\n") == 1 and flag in err, err
    assert err.startswith("python -m megatron_2bw.planner: error: ")


def test_a_plan_that_fits_only_sharded_launches_with_the_distributed_optimizer(tmp_path,
                                                                              capsys):
    """On a device that fits only the sharded optimizer's plans (3 layers on 2 devices:
    DP = 2), the emitted launch passes --use-distributed-optimizer, which the trainer's
    parser and checks accept at that size; planned without it, nothing fits."""
    from megatron_2bw.planner import PRESETS, SearchSpace
    from tests.test_planner_sharding import THREE, _capacity_between, cost_model
    space = SearchSpace(2, 8, tensor_parallel_sizes=(1,))
    hw = tmp_path / "hw.json"
    hw.write_text(json.dumps({**PRESETS["p3.16xlarge"].to_dict(), "name": "tight",
                              "memory_per_device_gb": _capacity_between(cost_model(THREE),
                                                                        space)}))
    plan = tmp_path / "plan.json"
    argv = ["--num-layers", "3", "--hidden-size", "512", "--num-attention-heads", "8",
            "--seq-length", "128", "--vocab-size", "1024", "--global-batch-size", "8",
            "--num-gpus", "2", "--tensor-parallel-sizes", "1", "--hardware", str(hw),
            "--json", str(plan)]
    code, text, err = planner(argv + ["--emit", "command", "--mock-data"] + LENGTH, capsys)
    assert code == 0, err
    _, args = trainer_args(launched_words("command", text, tmp_path, 1))
    assert args.use_distributed_optimizer
    assert json.loads(plan.read_text())["best"]["distributed_optimizer"] is True
    code, _, err = planner(argv + ["--distributed-optimizer", "off"], capsys)
    assert code == 1 and "no configuration" in err


def test_sequence_and_context_parallel_plans_launch_with_their_flags(tmp_path, capsys):
    """A plan with TP > 1 and CP > 1 launches with --sequence-parallel,
    --context-parallel-size and --attention-dropout 0 (context-parallel attention has no
    dropout), which the trainer's parser and checks accept; --no-sequence-parallel drops
    the first."""
    plan = tmp_path / "plan.json"
    argv = (SMALL + ["--num-gpus", "8", "--hardware", "p4d.24xlarge", "--json", str(plan),
                     "--tensor-parallel-sizes", "2", "--context-parallel-sizes", "2",
                     "--emit", "command", "--mock-data"] + LENGTH)
    code, text, err = planner(argv, capsys)
    assert code == 0, err
    assert "--sequence-parallel --context-parallel-size 2 --attention-dropout 0" in text
    _, args = trainer_args(launched_words("command", text, tmp_path, 1))
    assert (args.tensor_model_parallel_size, args.sequence_parallel,
            args.context_parallel_size, args.attention_dropout) == (2, True, 2, 0.0)
    best = json.loads(plan.read_text())["best"]
    assert (best["sequence_parallel"], best["context_parallel"]) == (True, 2)
    code, text, err = planner(argv + ["--no-sequence-parallel"], capsys)
    assert code == 0 and "--sequence-parallel" not in text, err
    assert "--context-parallel-size 2" in text


def test_bad_launch_object_in_a_hardware_file_names_hardware(tmp_path, capsys):
    hw = tmp_path / "hw.json"
    hw.write_text(json.dumps({**CPU_HARDWARE, "launch": {"gpus": "no"}}))
    code, _, err = planner(SMALL + ["--num-gpus", "2", "--hardware", str(hw), "--emit",
                                    "command", "--mock-data"] + LENGTH, capsys)
    assert code == 2 and "--hardware" in err and '"launch"' in err


# ---------------------------------------------------------------- real runs (slow)

def _tiny_job(tmp_path: Path, form: str, capsys) -> tuple[Path, Path]:
    """The tiny GPT's launch on two one-process "nodes" of this machine, on the embedded
    corpus; returns the script and the metrics file."""
    from megatron_2bw.data.default_data import ensure_default_data
    data = ensure_default_data(os.path.join(ROOT, "data", "cache"))
    hw = tmp_path / "cpu.json"
    hw.write_text(json.dumps(CPU_HARDWARE))
    script, metrics = tmp_path / f"{form}.sh", tmp_path / "metrics.jsonl"
    argv = (["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
             "--seq-length", "32", "--vocab-size", "4096", "--global-batch-size", "8",
             "--num-gpus", "2", "--hardware", str(hw), "--emit", form, "--output", str(script),
             "--train-iters", "3", "--lr", "1e-3", "--eval-iters", "1", "--log-interval", "1",
             "--save", str(tmp_path / "ckpt"), "--bf16", "--split", "949,50,1"]
            + data.gpt_flags() + ["--", "--metrics-file", str(metrics)])
    code, out, err = planner(argv, capsys)
    assert code == 0 and f"Wrote {script}" in out, err
    return script, metrics


def _trained(metrics: Path, tmp_path: Path, outputs: list[str]) -> None:
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    losses = [r["loss"] for r in rows if r.get("split", "train") == "train" and "loss" in r]
    assert len(losses) == 3 and all(0 < x < 20 for x in losses), outputs
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "3"


@pytest.mark.slow
def test_torchrun_script_trains_on_two_nodes_of_this_machine(tmp_path, capsys):
    script, metrics = _tiny_job(tmp_path, "torchrun", capsys)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               PYTHON=sys.executable, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    nodes = [subprocess.Popen(["bash", str(script)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outputs = [p.communicate(timeout=240)[0] for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], [o[-3000:] for o in outputs]
    _trained(metrics, tmp_path, [o[-3000:] for o in outputs])


@pytest.mark.slow
def test_sbatch_script_trains_with_srun_and_scontrol_stubbed(tmp_path, capsys):
    script, metrics = _tiny_job(tmp_path, "sbatch", capsys)
    env = slurm_env(stubs(tmp_path), 2, MASTER_PORT=str(free_port()), PYTHON=sys.executable,
                    OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    _trained(metrics, tmp_path, [(proc.stdout + proc.stderr)[-3000:]])


# ---------------------------------------------------------------- examples/aws

AWS = Path(ROOT) / "examples" / "aws"
AWS_SCRIPTS = ("pretrain_gpt_2bw_p4d.sbatch", "pretrain_gpt_2bw_p5.sbatch",
               "pretrain_gpt_2bw_ec2.sh")


def _header_command(text: str) -> list[str]:
    """The planner argv of a script's `# Written by:` comment (wrapped), without --output."""
    lines = text.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("# Written by: "))
    parts = [lines[start].removeprefix("# Written by: ")]
    for ln in lines[start + 1:]:
        if not ln.startswith("#     "):
            break
        parts.append(ln[1:].strip())
    words = shlex.split(" ".join(parts))[3:]  # drop `python -m megatron_2bw.planner`
    cut = words.index("--output")
    return words[:cut] + words[cut + 2:]


def _arrays(text: str) -> dict[str, list[str]]:
    """The bash arrays of an emitted script, read statically (the example paths are on
    /fsx, so the scripts cannot run here)."""
    arrays, name = {}, None
    for ln in text.splitlines():
        if ln.endswith("=(") and not ln.startswith(" "):
            name, arrays[ln[:-2]] = ln[:-2], []
        elif ln == ")":
            name = None
        elif name:
            arrays[name] += shlex.split(ln)
    return arrays


@pytest.mark.parametrize("name", AWS_SCRIPTS)
def test_aws_examples_are_the_planners_launches_and_the_trainer_accepts_them(name, capsys):
    """Each example is what its header's planner command writes now (else: rerun that
    command with --output examples/aws/NAME), is valid bash, and its flags pass the
    trainer's and torchrun's parsers."""
    text = (AWS / name).read_text()
    code, again, err = planner(_header_command(text), capsys)
    assert code == 0, err
    body = [ln for ln in text.splitlines() if not ln.startswith("#  ") and "Written by" not in ln]
    assert body == [ln for ln in again.splitlines()
                    if not ln.startswith("#  ") and "Written by" not in ln], \
        f"examples/aws/{name} is stale: rerun the planner command in its header"
    subprocess.run(["bash", "-n", str(AWS / name)], check=True)
    arrays = _arrays(text)
    launch = ["4" if w == "$SLURM_NNODES" else w for w in arrays.pop("LAUNCH_ARGS")]
    launcher, args = trainer_args(launch + ["pretrain_gpt.py"]
                                  + [w for words in arrays.values() for w in words])
    assert args.save == args.load == "/fsx/checkpoints/gpt-2.2b-2bw" and args.bf16
    assert "source /fsx/megatron-2bw/examples/aws/efa.env" in text


def test_aws_environment_and_cluster_configurations_parse():
    subprocess.run(["bash", "-n", str(AWS / "efa.env")], check=True)
    env = subprocess.run(["bash", "-c", f"set -eu; source {AWS / 'efa.env'}; env"],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert {"FI_PROVIDER=efa", "FI_EFA_USE_DEVICE_RDMA=1"} <= set(env)
    yaml = pytest.importorskip("yaml")
    for instance in ("p4d.24xlarge", "p5.48xlarge"):
        config = yaml.safe_load((AWS / f"pcluster-{instance.split('.')[0]}.yaml").read_text())
        queue = config["Scheduling"]["SlurmQueues"][0]
        resource = queue["ComputeResources"][0]
        assert config["Scheduling"]["Scheduler"] == "slurm"
        assert resource["InstanceType"] == instance and resource["Efa"]["Enabled"] is True
        assert queue["Networking"]["PlacementGroup"]["Enabled"] is True
        assert len(queue["Networking"]["SubnetIds"]) == 1  # EFA stays in one zone
        fsx = config["SharedStorage"][0]
        assert (fsx["StorageType"], fsx["MountDir"]) == ("FsxLustre", "/fsx")


def test_help_lists_the_launch_flags(capsys):
    with pytest.raises(SystemExit) as stop:
        cli_main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert stop.value.code == 0 and "--emit {command,torchrun,sbatch}" in out
    assert "--data-path" in out and "10000 + job id % 20000" in out
