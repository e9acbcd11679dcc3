# Sourced by the scripts: find_python prints a command that runs Python >= 3.12, or fails
# saying so. The first interpreter that really runs (pyenv shims may exist but not run).
find_python() {
  local ok='import sys; sys.exit(sys.version_info < (3, 12))'
  for candidate in python3.12 python3.13 python3; do
    if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c "$ok" >/dev/null 2>&1; then
      echo "$candidate"; return
    fi
  done
  if command -v pyenv >/dev/null 2>&1; then
    for v in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.1[2-9]' | sort -V); do
      if PYENV_VERSION=$v python3 -c "$ok" >/dev/null 2>&1; then
        echo "env PYENV_VERSION=$v python3"; return
      fi
    done
  fi
  echo "jax_cpgrad needs Python >= 3.12 (jax 0.11+); none found" >&2
  return 1
}
