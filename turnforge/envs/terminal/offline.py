"""Offline stand-ins for the installers that tasks' scripts call, on the box's PATH first.

Real Harbor tasks (Terminal-Bench 2.0) install ``uv`` with ``curl | sh`` and run ``uvx ... pytest``,
or ``pip install pytest``, ``apt-get install curl``, before their tests. The sandbox has no
network, so these commands are answered here: what the host already has succeeds without
downloading anything, anything else fails with a line saying it is not available offline (the
task loader, ``turnforge.envs.terminal.harbor``, refuses such tasks before any work, so a failure
here is an agent's own ``apt-get install`` of something missing).

- ``uvx [uv options] pytest ARGS`` -> ``python3 -m pytest ARGS`` (``--ctrf PATH`` dropped when the
  pytest-json-ctrf plugin is missing); ``uv`` answers ``--version`` only;
- ``pip``/``pip3 install R...`` succeeds when every requirement's distribution is installed;
- ``apt-get``/``apt``: ``update`` succeeds, ``install P...`` when every package is installed
  (``dpkg-query`` on the host's database, bound read-only) or is a command on PATH;
- ``curl``: the uv installer's URL prints an empty script; anything else fails (no network);
- ``python`` -> ``python3`` (tests call ``python``, which a uv environment would provide).
"""

from __future__ import annotations

#: Where the stand-ins are written in a box (first on its PATH).
OFFLINE_BIN = "/tmp/.offline/bin"
PATH = f"{OFFLINE_BIN}:/usr/local/bin:/usr/bin:/bin"

_UVX = r'''#!/bin/bash
# turnforge offline stand-in: uvx [uv options] pytest ARGS -> python3 -m pytest ARGS
while [ $# -gt 0 ]; do
  case "$1" in
    -p|--python|-w|--with|--index|--index-url|--extra-index-url|--index-strategy|--from) shift 2 ;;
    --python=*|--with=*|--index=*|--index-url=*|--index-strategy=*|--from=*|-q|--quiet|--no-cache|--isolated|--offline) shift ;;
    *) break ;;
  esac
done
tool="$1"; shift
[ "$tool" = "pytest" ] || { echo "uvx (offline): only pytest is available without the network, not '$tool'" >&2; exit 127; }
ctrf=$(python3 -c 'import importlib.util as u; print(int(u.find_spec("pytest_jsonctrf") is not None))')
args=()
while [ $# -gt 0 ]; do
  if [ "$ctrf" = 0 ] && [ "$1" = "--ctrf" ]; then shift 2; continue; fi
  if [ "$ctrf" = 0 ] && [[ "$1" == --ctrf=* ]]; then shift; continue; fi
  args+=("$1"); shift
done
exec python3 -m pytest -p no:cacheprovider "${args[@]}"
'''

_UV = r'''#!/bin/bash
# turnforge offline stand-in for uv
[ "$1" = "--version" ] && { echo "uv (offline stand-in)"; exit 0; }
echo "uv (offline): '$*' needs the network, which this sandbox does not have" >&2; exit 2
'''

_PIP = r'''#!/bin/bash
# turnforge offline stand-in: pip install succeeds when every requirement is already installed
if [ "$1" = "install" ]; then
  shift; missing=()
  for r in "$@"; do
    case "$r" in -*) continue ;; esac
    name=${r%%[=<>!~\[]*}
    case "$name" in pytest-json-ctrf) continue ;; esac
    python3 -c 'import importlib.metadata as m, sys; m.version(sys.argv[1])' "$name" 2>/dev/null || missing+=("$r")
  done
  [ ${#missing[@]} -eq 0 ] && { echo "pip (offline): already installed"; exit 0; }
  echo "pip (offline): not installed and no network to install: ${missing[*]}" >&2; exit 1
fi
exec python3 -m pip "$@"
'''

_APT = r'''#!/bin/bash
# turnforge offline stand-in: apt-get install succeeds when every package is already installed
case "$1" in update|clean|autoclean|autoremove) exit 0 ;; esac
if [ "$1" = "install" ]; then
  shift; missing=()
  for p in "$@"; do
    case "$p" in -*) continue ;; esac
    p=${p%%=*}
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" && continue
    command -v "$p" >/dev/null 2>&1 && continue
    missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && { echo "apt-get (offline): already installed"; exit 0; }
  echo "apt-get (offline): not installed and no network to install: ${missing[*]}" >&2; exit 100
fi
echo "apt-get (offline): '$*' needs the network, which this sandbox does not have" >&2; exit 100
'''

_CURL = r'''#!/bin/bash
# turnforge offline stand-in: the uv installer becomes an empty script; nothing else is downloaded
for a in "$@"; do case "$a" in *astral.sh/uv/*) echo 'true'; exit 0 ;; esac; done
echo "curl (offline): no network in this sandbox: $*" >&2; exit 6
'''

_PYTHON = '#!/bin/sh\nexec python3 "$@"\n'

#: Each stand-in's name and script.
SHIMS: dict[str, str] = {"uvx": _UVX, "uv": _UV, "pip": _PIP, "pip3": _PIP, "apt-get": _APT, "apt": _APT,
                         "curl": _CURL, "python": _PYTHON}


def shim_files() -> dict[str, bytes]:
    """The stand-ins as files of ``OFFLINE_BIN`` (path -> bytes), to write with mode 0o755."""
    return {f"{OFFLINE_BIN}/{name}": text.encode() for name, text in SHIMS.items()}


#: ``$HOME/.local/bin/env``, which the uv installer would have written and test.sh files source.
UV_ENV = 'export PATH="$HOME/.local/bin:$PATH"\n'
