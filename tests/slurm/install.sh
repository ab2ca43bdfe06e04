#!/usr/bin/env bash
# What tests/slurm needs from the system: Slurm's daemons and client commands and munge, from the distribution's
# packages (Debian/Ubuntu: apt-get, as root). Idempotent: quick when they are there. Never fails the test command:
# where they cannot be installed it says why, and the Slurm tests skip with that reason. (Hydra's submitit
# launcher comes with the dev extra.)
set -uo pipefail

missing=()
for cmd in munged mungekey slurmctld slurmd sbatch scontrol; do
  command -v "$cmd" >/dev/null 2>&1 || missing+=("$cmd")
done
((${#missing[@]} == 0)) && exit 0

say() { echo "tests/slurm/install.sh: $*; the Slurm tests will skip" >&2; }
if ! command -v apt-get >/dev/null 2>&1; then
  say "no apt-get on this machine to install ${missing[*]}"
elif [[ $(id -u) != 0 ]]; then
  say "installing ${missing[*]} needs root"
else
  packages=(slurmctld slurmd slurm-client munge)
  export DEBIAN_FRONTEND=noninteractive
  # The package lists of a fresh image may be missing or stale: update them only when the install needs it.
  apt-get install -y -q --no-install-recommends "${packages[@]}" >/dev/null 2>&1 ||
    { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q --no-install-recommends "${packages[@]}" >/dev/null 2>&1; } ||
    say "apt-get could not install ${packages[*]}"
fi
exit 0
