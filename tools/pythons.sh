# Sourced by tools/build_wheel.sh, tools/wheel_check.sh and tools/test_pythons.sh: which CPython
# versions the wheels cover, and where each interpreter is on this machine.
# shellcheck shell=bash

# The CPython versions umbp_nvme supports and builds a wheel for (setup.cfg: python_requires).
SUPPORTED_PYTHONS="3.10 3.11 3.12 3.13"

# find_python 3.12 -> the path of a CPython 3.12 interpreter, or nothing (exit 1). Looks at
# python3.12 on PATH (a pyenv shim for a version pyenv has not enabled answers nothing, so each
# candidate must report its version), then pyenv's versions (the newest 3.12.*), then /usr/bin and
# /usr/local/bin.
find_python() {
  local v=$1 c
  local pyenv_root=${PYENV_ROOT:-$HOME/.pyenv}
  for c in "$(command -v "python$v" 2>/dev/null)" \
           $(ls -d "$pyenv_root"/versions/"$v".*/bin/"python$v" 2>/dev/null | sort -V -r) \
           "/usr/bin/python$v" "/usr/local/bin/python$v"; do
    [[ -n "$c" && -x "$c" ]] || continue
    if [[ "$("$c" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)" == "$v" ]]; then
      echo "$c"
      return 0
    fi
  done
  return 1
}

# missing_python 3.10 WHO: the line that says an interpreter was not found and how to get one.
missing_python() {
  echo "$2: no CPython $1 on this machine (looked for python$1 on PATH, in pyenv's versions, /usr/bin and" \
       "/usr/local/bin); install it (Debian/Ubuntu: apt-get install python$1-dev python$1-venv, or" \
       "pyenv install $1) or leave it out of PYTHONS" >&2
}
