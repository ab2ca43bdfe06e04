"""Plant one-line bugs in the training maths, one at a time, and see whether a test suite catches each.

    python benchmarks/planted_bugs.py --tree DIR --python PY --out results.json [-- pytest args]

For each bug: copy ``DIR``'s tracked files (``git -C DIR ls-files``, as they were when the script started) into a
scratch folder, make the one edit, run ``PY -m pytest -x -q -p no:cacheprovider <pytest args>`` there (its
moe_tune first on the path, also for the processes tests start), and record whether it failed (caught) and how
long it took. The unedited tree runs
first: a suite that fails as it is would make every bug look caught, so the script stops there.

A bug names the file under either layout of the package (before and after the house's moves, issue 37) and the
exact text it replaces, which must occur exactly once; ``--only`` picks bugs by name. Run it against an older
commit's tree and the current one with the same bugs to compare what each suite catches.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Bug:
    name: str
    what: str
    paths: tuple[str, ...]  # the file under each layout; the first that exists is edited
    old: tuple[str, ...]  # the text replaced, per layout where it differs; the first found is edited
    new: str


BUGS = [
    Bug(
        "norm_topk",
        "the top-k gates are no longer renormalised to sum to 1 (norm_topk_prob ignored)",
        ("moe_tune/moe/router.py",),
        ("if s.norm_topk_prob:",),
        "if False:",
    ),
    Bug(
        "aux_loss_scale",
        "the load-balancing loss loses its factor E",
        ("moe_tune/moe/router.py",),
        ("return (f_E * P_E).sum() * E",),
        "return (f_E * P_E).sum()",
    ),
    Bug(
        "z_loss_square",
        "the router z-loss takes logsumexp instead of its square",
        ("moe_tune/moe/router.py",),
        ("torch.logsumexp(logits_TE.float(), dim=-1).square().mean()",),
        "torch.logsumexp(logits_TE.float(), dim=-1).mean()",
    ),
    Bug(
        "bias_update_sign",
        "the aux-loss-free bias moves towards the overloaded experts",
        ("moe_tune/moe/router.py",),
        ("delta = torch.sign(load.mean(dim=-1, keepdim=True) - load) * rate",),
        "delta = torch.sign(load - load.mean(dim=-1, keepdim=True)) * rate",
    ),
    Bug(
        "accum_extra_loss",
        "the balancing losses are summed over micro-batches instead of averaged",
        ("moe_tune/train/trainer.py",),
        ("extra = (out.loss - out.ce_loss) / layout.accum", "extra = (out.loss - out.ce_loss) / self.accum"),
        "extra = out.loss - out.ce_loss",
    ),
    Bug(
        "loss_normalizer_dp",
        "each rank divides its token-loss sum by the global token count (gradients too small by dp)",
        ("moe_tune/train/trainer.py",),
        ("return total.clamp(min=1) / self.layout.dp_size", "return total.clamp(min=1) / self.dp_size"),
        "return total.clamp(min=1)",
    ),
    Bug(
        "adamw_bias_correction",
        "AdamW drops the first moment's bias correction",
        ("moe_tune/optim/adamw.py",),
        ("(lr / bc1) * m32",),
        "lr * m32",
    ),
    Bug(
        "ce_ignore",
        "the loss counts ignored (label -100) rows, as the logsumexp of their logits",
        ("moe_tune/kernels/loss.py",),
        ("loss_N = torch.where(valid_N, lse_N - x.gather(1, safe_N).squeeze(1), 0.0)",),
        "loss_N = torch.where(valid_N, lse_N - x.gather(1, safe_N).squeeze(1), lse_N)",
    ),
    Bug(
        "warmup_off_by_one",
        "linear warm-up starts at 0 instead of 1 / warmup_steps",
        ("moe_tune/optim/__init__.py",),
        ("return (step + 1) / cfg.warmup_steps",),
        "return step / cfg.warmup_steps",
    ),
    Bug(
        "clip_coef",
        "gradient clipping scales by max_norm / norm without the cap at 1 (it also scales small gradients up)",
        ("moe_tune/distributed/clip.py", "moe_tune/parallel/clip.py"),
        ("coef = (max_norm / (total + 1e-6)).clamp(max=1.0)",),
        "coef = max_norm / (total + 1e-6)",
    ),
    Bug(
        "clip_divisor",
        "the optimizer's clipping divisor may fall below 1 (gradients under max_grad_norm are scaled up)",
        ("moe_tune/distributed/clip.py", "moe_tune/parallel/clip.py"),
        ("return ((total_norm + 1e-6) / max_norm).clamp(min=1.0)",),
        "return (total_norm + 1e-6) / max_norm",
    ),
    Bug(
        "packed_positions",
        "packed rows' position ids run on across samples instead of restarting at each",
        ("moe_tune/data/packing.py",),
        ("pos += range(len(s_ids))",),
        "pos += range(len(pos), len(pos) + len(s_ids))",
    ),
    Bug(
        "prompt_labels",
        "assistant-only loss trains on the prompt too",
        ("moe_tune/data/encode.py",),
        ('labels = ids if self.train_on == "all" else [IGNORE] * len(prompt) + completion',),
        'labels = ids if self.train_on == "all" else prompt + completion',
    ),
    Bug(
        "swiglu_swap",
        "the experts' SwiGLU applies silu to up instead of gate",
        ("moe_tune/moe/experts.py",),
        ("return F.silu(gate) * up",),
        "return gate * F.silu(up)",
    ),
    Bug(
        "combine_gates",
        "the local combine ignores the gates (every chosen expert weighs 1)",
        ("moe_tune/moe/dispatch/base.py",),
        ("return torch.bmm(weights_TK.to(y_TKD.dtype).unsqueeze(1), y_TKD).squeeze(1)",),
        "return y_TKD.sum(dim=1)",
    ),
    # LoRA on a quantized base and FP8 checkpoints (issue 34): storage, reading and merging.
    Bug(
        "nf4_nibble_order",
        "NF4 codes are packed with the upper nibble first, while they are read lower nibble first",
        ("moe_tune/kernels/nf4_frozen.py",),
        ("packed = codes[..., 0::2] | (codes[..., 1::2] << 4)",),
        "packed = codes[..., 1::2] | (codes[..., 0::2] << 4)",
    ),
    Bug(
        "nf4_round_up",
        "NF4 quantization rounds each value up to the next code instead of to the nearest",
        ("moe_tune/kernels/nf4_frozen.py",),
        ("midpoints = (table[1:] + table[:-1]) / 2",),
        "midpoints = table[:-1]",
    ),
    Bug(
        "nf4_first_block_scale",
        "NF4 dequantization scales every block of a row by the row's first block scale",
        ("moe_tune/kernels/nf4_frozen.py",),
        ("blocks = values.reshape(e, N, scales.shape[-1], -1) * scales.float().unsqueeze(-1)",),
        "blocks = values.reshape(e, N, scales.shape[-1], -1) * scales.float()[..., :1].unsqueeze(-1)",
    ),
    Bug(
        "quantized_fill_offset",
        "a quantized base's experts loaded in chunks all land at the first local expert",
        ("moe_tune/moe/quantized_base.py",),
        ("self.codes[first : first + codes.shape[0]].copy_(codes)",),
        "self.codes[: codes.shape[0]].copy_(codes)",
    ),
    Bug(
        "fp8_base_padding_rows",
        "the FP8 base's input gradient scales a dispatcher's padding rows by 1 instead of 0",
        ("moe_tune/kernels/fp8_frozen.py",),
        ("col_scale_GN = torch.cat([s_eN, s_eN.new_zeros(1, N)])",),
        "col_scale_GN = torch.cat([s_eN, s_eN.new_ones(1, N)])",
    ),
    Bug(
        "fp8_pow2_mantissa",
        "the FP8 power-of-two scale ignores the mantissa, so rows whose absmax mantissa exceeds 0.875 saturate",
        ("moe_tune/kernels/fp8_grouped.py",),
        ("power = 9 - exponent - (mantissa > 0.875).to(exponent.dtype)",),
        "power = 9 - exponent",
    ),
    Bug(
        "fp8_release_block_rows",
        "an FP8 release's rows read from a range starting mid-checkpoint take the scales of the first blocks",
        ("moe_tune/models/fp8_checkpoint.py",),
        ("rows = torch.arange(start, start + r) // bn - start // bn",),
        "rows = torch.arange(r) // bn",
    ),
    Bug(
        "expert_merge_scaling",
        "merging expert adapters drops LoRA's alpha / rank scaling",
        ("moe_tune/lora/experts.py",),
        ("return torch.bmm(B_eNr.float(), A_erK.float()) * self.scaling",),
        "return torch.bmm(B_eNr.float(), A_erK.float())",
    ),
]


def plant(root: str, bug: Bug) -> str:
    """Edit ``root``'s copy of the file; returns the path edited (relative)."""
    for rel in bug.paths:
        path = os.path.join(root, rel)
        if not os.path.exists(path):
            continue
        text = open(path).read()
        for old in bug.old:
            if text.count(old) == 1:
                with open(path, "w") as f:
                    f.write(text.replace(old, bug.new))
                return rel
        raise SystemExit(f"bug {bug.name}: none of its texts occurs exactly once in {rel}; update the bug")
    raise SystemExit(f"bug {bug.name}: none of {', '.join(bug.paths)} exists under {root}; update the bug")


def copy_tree(tree: str, dest: str) -> None:
    files = subprocess.run(["git", "-C", tree, "ls-files", "-z"], capture_output=True, check=True).stdout
    for rel in files.decode().split("\0"):
        if rel and os.path.isfile(os.path.join(tree, rel)):
            os.makedirs(os.path.dirname(os.path.join(dest, rel)) or dest, exist_ok=True)
            shutil.copy2(os.path.join(tree, rel), os.path.join(dest, rel))


def run_suite(root: str, python: str, pytest_args: list[str], log: str) -> tuple[int, float]:
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [python, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *pytest_args]
    start = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.run(cmd, cwd=root, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    return rc, time.perf_counter() - start


def first_failure(log: str) -> str:
    for line in open(log):
        if line.startswith("FAILED ") or line.startswith("ERROR "):
            return line.split(" - ")[0].split(" ", 1)[1].strip()
    return ""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", required=True, help="a git checkout whose tracked files are copied")
    p.add_argument("--python", default=sys.executable, help="the interpreter with that tree's dependencies")
    p.add_argument("--out", required=True, help="JSON results (a .log per bug beside it)")
    p.add_argument("--only", nargs="*", help="bug names (default: all)")
    p.add_argument("--skip-clean", action="store_true", help="do not run the unedited tree first")
    p.add_argument("pytest_args", nargs="*", help="after --: arguments for pytest")
    a = p.parse_args()
    bugs = [b for b in BUGS if not a.only or b.name in a.only]
    commit = subprocess.run(["git", "-C", a.tree, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    logs = os.path.splitext(a.out)[0]
    os.makedirs(logs, exist_ok=True)
    rows = []
    # One copy of the tree taken now, each bug's from it: edits to the tree while the bugs run (minutes each) reach
    # neither the bugs nor the unedited run they are measured against.
    snapshot = tempfile.TemporaryDirectory(prefix="planted-tree-")
    copy_tree(a.tree, snapshot.name)
    for bug in [None] * (not a.skip_clean) + bugs:
        with tempfile.TemporaryDirectory(prefix="planted-") as root:
            shutil.copytree(snapshot.name, root, dirs_exist_ok=True)
            edited = plant(root, bug) if bug else ""
            name = bug.name if bug else "clean"
            log = os.path.join(logs, f"{name}.log")
            rc, seconds = run_suite(root, a.python, a.pytest_args, log)
        if bug is None and rc != 0:
            raise SystemExit(f"the unedited tree fails ({first_failure(log)}): see {log}")
        failed = first_failure(log)  # a test that failed (a non-zero exit alone may be pytest's own error)
        row = {"bug": name, "what": bug.what if bug else "", "file": edited, "caught": bool(failed), "rc": rc}
        row.update(seconds=round(seconds, 1), first_failure=failed)
        rows.append(row)
        print(json.dumps(row), flush=True)
        with open(a.out, "w") as f:
            json.dump({"tree": a.tree, "commit": commit, "pytest_args": a.pytest_args, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
