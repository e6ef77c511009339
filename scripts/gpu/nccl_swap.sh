#!/usr/bin/env bash
# Run one command with another NCCL build in torch's place, then put the bundled one back.
#
#   scripts/gpu/nccl_swap.sh [--dry-run] SRC_DIR -- COMMAND [ARGS...]
#
# SRC_DIR holds the build as split xz parts (libnccl.so.2.xz.part00, part01, ...) and
# sha256.txt (a "HASH  .../libnccl.so.2" line for the library), as the project carries
# NCCL 2.30.7 in the ignored folder .nccl/ (docs/design/2026-12-02-emulation.md). The library is
# unpacked, checked against its hash, and moved over torch's libnccl.so.2 (the nvidia-nccl
# wheel's file; LD_PRELOAD does not take: torch binds its RPATH copy). The bundled file is
# backed up first and restored when this script exits, whatever the command did (trap
# EXIT/INT/TERM). Exit status: the command's. Replacing is a rename, never an overwrite in
# place: processes that have the old file mapped keep a valid mapping.
#   --dry-run   print what would be done (paths, hashes), change nothing, run nothing
# Environment: NCCL_LIB (the file to replace; default: the libnccl torch maps when imported,
# else nvidia.nccl.__path__'s lib/libnccl.so.2), PYTHON (default python3).
# torch 2.11's comm = "symm_mem" (NCCL's symmetric-memory backend) breaks under 2.30.7:
# keep the swap to the commands that need the newer NCCL.
set -uo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PYTHON="${PYTHON:-python3}"
dry_run=0
die() { echo "nccl_swap.sh: error: $*" >&2; exit 2; }

[[ "${1:-}" == --dry-run ]] && { dry_run=1; shift; }
src="${1:-}"
[[ -n "$src" ]] || die "usage: nccl_swap.sh [--dry-run] SRC_DIR -- COMMAND [ARGS...]"
shift
[[ "${1:-}" == -- ]] && shift
(($#)) || die "no command to run after the swap (nccl_swap.sh SRC_DIR -- COMMAND ...)"
[[ -d "$src" ]] || die "$src is not a folder (it holds libnccl.so.2.xz.part* and sha256.txt)"
shopt -s nullglob
parts=("$src"/libnccl.so.2.xz.part*)
shopt -u nullglob
((${#parts[@]})) || die "no libnccl.so.2.xz.part* in $src"
want=$(awk '$2 ~ /(^|\/)libnccl\.so\.2$/ {print $1; exit}' "$src/sha256.txt" 2>/dev/null)
[[ -n "$want" ]] || die "$src/sha256.txt has no 'HASH  libnccl.so.2' line"

target="${NCCL_LIB:-}"
if [[ -z "$target" ]]; then
  # The file torch maps at import (its RPATH copy), else the nvidia-nccl wheel's.
  target=$(PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -c 'import os
from torchtitan_tide.comm.transports.windows.nccl_rma import library_path
def wheel():
    try:
        import nvidia.nccl
    except ImportError:
        return ""
    return os.path.join(list(nvidia.nccl.__path__)[0], "lib", "libnccl.so.2")
print(library_path() or wheel())') || target=""
  [[ -n "$target" ]] || die "torch's libnccl.so.2 not found (not mapped by torch, no nvidia.nccl package); set NCCL_LIB=/path/to/libnccl.so.2"
fi
[[ -f "$target" ]] || die "$target (the library to replace) does not exist; set NCCL_LIB"
have=$(sha256sum "$target" | awk '{print $1}')
if [[ "$have" == "$want" ]]; then
  die "$target is already the build of $src (a swap that was not undone?): reinstall the bundled NCCL (pip install --force-reinstall --no-deps nvidia-nccl-cu13) before swapping"
fi

if ((dry_run)); then
  echo "[nccl_swap] dry run: would unpack ${#parts[@]} part(s) of $src, expecting sha256 $want"
  echo "[nccl_swap] dry run: would back up $target (sha256 $have) and move the build over it"
  printf '[nccl_swap] dry run: would run:'; printf ' %q' "$@"; echo
  echo "[nccl_swap] dry run: would restore $target (sha256 $have) on exit"
  exit 0
fi

work=$(mktemp -d /tmp/nccl_swap.XXXXXX) || die "mktemp failed"
backup="$work/libnccl.so.2.bundled"
swapped=0
restore() {
  local rc=$?
  if ((swapped)); then
    if cp -p "$backup" "$target.restore.$$" && mv -f "$target.restore.$$" "$target"; then
      echo "[nccl_swap] restored $target (sha256 $(sha256sum "$target" | awk '{print $1}'))"
    else
      echo "nccl_swap.sh: error: could not restore $target; the bundled file is $backup" >&2
      exit 3
    fi
  fi
  rm -rf "$work"
  exit "$rc"
}
trap restore EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

cat "${parts[@]}" | xz -d > "$work/libnccl.so.2" || die "unpacking ${parts[*]} failed"
got=$(sha256sum "$work/libnccl.so.2" | awk '{print $1}')
[[ "$got" == "$want" ]] || die "unpacked library sha256 $got, $src/sha256.txt says $want"
cp -p "$target" "$backup" || die "backing up $target failed"
swapped=1  # from here on restore on any exit: the backup over an unchanged target is harmless
cp "$work/libnccl.so.2" "$target.swap.$$" && chmod --reference="$backup" "$target.swap.$$" \
  && mv -f "$target.swap.$$" "$target" || die "could not replace $target"
echo "[nccl_swap] $target <- $src (sha256 $want); bundled copy backed up (sha256 $have)"
# In the background and waited for: a signal to this script then ends the command and
# restores at once (bash runs traps only between commands, and during `wait`).
# Its own process group (job control), so a signal reaches everything it started (a
# `bash -c` running pytest and its spawned ranks), not only the direct child.
set -m
"$@" &
child=$!
set +m
trap 'kill -TERM -- -"$child" 2>/dev/null; wait "$child"; exit 143' TERM
trap 'kill -TERM -- -"$child" 2>/dev/null; wait "$child"; exit 130' INT  # a background command ignores SIGINT
wait "$child"
