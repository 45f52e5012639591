#!/usr/bin/env bash
# Install or upgrade sokratos-worker as a systemd service. Idempotent: run it again after an
# upgrade or after adding a secret to /etc/sokratos-worker/credentials/.
set -euo pipefail

APP=sokratos-worker
SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_DIR=$(cd "$SCRIPT_DIR/.." && pwd)

usage() {
    cat <<USAGE
Usage: install.sh [OPTIONS] [SOURCE]

Install sokratos-worker under /opt/$APP with its systemd units (run as root).

SOURCE is what pip installs: a source checkout, a wheel, or a requirement such as
"sokratos-worker==0.1.0". Default: the checkout this script belongs to ($REPO_DIR).

What it does (each step only when needed):
  1. creates the virtualenv /opt/$APP/venv and pip-installs SOURCE into it (upgrading);
  2. installs $APP.service and $APP@.service into /etc/systemd/system/;
  3. creates /etc/$APP/env from the example (mode 0640) if it does not exist;
  4. creates /etc/$APP/credentials/ (mode 0700) and writes the units' drop-ins
     ($APP.service.d/credentials.conf, $APP@.service.d/credentials.conf) with one
     LoadCredential= line per file found there;
  5. runs "systemctl daemon-reload" when systemd is running.
It never enables or starts the service and never overwrites /etc/$APP/env.

Options:
  --prefix DIR     install under DIR instead of / (a staging root: the units and the venv's
                   scripts refer to /opt/$APP, so they run once the tree is copied to /;
                   no root needed, systemctl is not called)
  --python PATH    the Python (3.11 or later) that creates the venv (default: the first
                   of python3, python3.13, python3.12, python3.11 that is recent enough)
  --extras LIST    pip extras to install, e.g. "local" for the bundled demonstration model;
                   placed where pip reads them: "${APP}[local]==0.1.0", "PATH[local]",
                   "${APP}[local] @ URL"
  --skip-venv      do not create or update the virtualenv (units and /etc only)
  -h, --help       show this help and exit
USAGE
}

PREFIX=""
PYTHON=""
EXTRAS=""
SKIP_VENV=0
SOURCE=""

while [[ $# -gt 0 ]]; do
    case "$1" in
        -h|--help) usage; exit 0 ;;
        --prefix) PREFIX=${2:?--prefix needs a directory}; shift 2 ;;
        --prefix=*) PREFIX=${1#*=}; shift ;;
        --python) PYTHON=${2:?--python needs a path}; shift 2 ;;
        --python=*) PYTHON=${1#*=}; shift ;;
        --extras) EXTRAS=${2:?--extras needs a list}; shift 2 ;;
        --extras=*) EXTRAS=${1#*=}; shift ;;
        --skip-venv) SKIP_VENV=1; shift ;;
        -*) echo "install.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
        *)
            if [[ -n "$SOURCE" ]]; then
                echo "install.sh: only one SOURCE may be given" >&2; exit 2
            fi
            SOURCE=$1; shift ;;
    esac
done

if [[ -n "$PREFIX" ]]; then
    mkdir -p "$PREFIX"
    PREFIX=$(cd "$PREFIX" && pwd)
elif [[ $(id -u) -ne 0 ]]; then
    echo "install.sh: run as root (or use --prefix DIR to stage an installation)" >&2
    exit 1
fi
SOURCE=${SOURCE:-$REPO_DIR}

OPT_DIR="$PREFIX/opt/$APP"
VENV="$OPT_DIR/venv"
ETC_DIR="$PREFIX/etc/$APP"
CRED_DIR="$ETC_DIR/credentials"
UNIT_DIR="$PREFIX/etc/systemd/system"
# What the units name, whatever the prefix: the paths on the target system.
LIVE_CRED_DIR="/etc/$APP/credentials"
LIVE_VENV="/opt/$APP/venv"

say() { printf '%s\n' "install.sh: $*"; }

find_python() {
    if [[ -n "$PYTHON" ]]; then
        echo "$PYTHON"; return
    fi
    local candidate
    for candidate in python3 python3.13 python3.12 python3.11; do
        # A name can exist and still not run (pyenv shims): try it.
        if "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 11))' >/dev/null 2>&1
        then
            command -v "$candidate"; return
        fi
    done
    echo "install.sh: no Python 3.11 or later found (use --python)" >&2
    exit 1
}

# SOURCE with the extras where pip looks for them: after the project's name in a requirement
# ("sokratos-worker[local]==0.1.0", "sokratos-worker[local] @ URL"), after a path
# ("./dist/x.whl[local]"), and for a bare URL as "sokratos-worker[local] @ URL".
with_extras() {
    local source=$1 extras=$2
    local name_re='^[[:space:]]*([A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?)([[:space:]]*\[([^]]*)\])?(.*)$'
    if [[ -z "$extras" ]]; then
        printf '%s\n' "$source"
    elif [[ "$source" =~ ^[A-Za-z][A-Za-z0-9+.-]*:// ]]; then
        printf '%s\n' "${APP}[${extras}] @ ${source}"
    elif [[ "$source" == */* || "$source" == .* || "$source" == ~* || -e "$source" ]] \
        && [[ ! "$source" =~ ^[^/@]+@ ]]; then
        printf '%s\n' "${source}[${extras}]"
    elif [[ "$source" =~ $name_re ]]; then
        local name=${BASH_REMATCH[1]} given=${BASH_REMATCH[4]} rest=${BASH_REMATCH[5]}
        # Extras already given ("name[x]==1") are kept, the new ones added.
        printf '%s\n' "${name}[${given:+$given,}${extras}]${rest}"
    else
        printf '%s\n' "${source}[${extras}]"
    fi
}

install_venv() {
    local python
    python=$(find_python)
    if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
        echo "install.sh: $python does not run or is older than Python 3.11" >&2
        exit 1
    fi
    mkdir -p "$OPT_DIR"
    if [[ ! -x "$VENV/bin/python" ]]; then
        if ! "$python" -c 'import ensurepip, venv' >/dev/null 2>&1; then
            echo "install.sh: $python cannot create a virtual environment;" \
                "on Debian/Ubuntu: apt-get install python3-venv" >&2
            exit 1
        fi
        say "creating $VENV"
        "$python" -m venv "$VENV"
    fi
    local requirement
    requirement=$(with_extras "$SOURCE" "$EXTRAS")
    say "installing $requirement"
    "$VENV/bin/python" -m pip install --quiet --upgrade "$requirement"
    if [[ "$SOURCE" == *.whl ]]; then
        # Every build is version 0.1.0: pip keeps an installed wheel of the same version (and
        # --quiet hid its note), so an upgrade from a new wheel left the old code in place.
        "$VENV/bin/python" -m pip install --quiet --force-reinstall --no-deps "$requirement"
    fi
    # (Through the venv's python: a staged launcher names /opt/..., which a re-run with
    # nothing to upgrade leaves as the last run relocated it.)
    "$VENV/bin/python" "$VENV/bin/$APP" --version >/dev/null || {
        echo "install.sh: $VENV/bin/$APP does not run" >&2
        exit 1
    }
    relocate_staged_venv
}

# pip writes the venv's own path into its scripts' #! lines (and activate scripts): a staged
# venv would name the staging directory, and the unit's ExecStart fail (203/EXEC) once the
# tree is copied to /. Point them at where the units run it.
relocate_staged_venv() {
    [[ -n "$PREFIX" ]] || return 0
    local staged=$VENV live=$LIVE_VENV file
    while IFS= read -r -d '' file; do
        sed -i "s|$staged|$live|g" "$file"
    done < <(grep -rlIZF -- "$staged" "$VENV/bin" || true)
    say "the staged venv's scripts name $live (they run once the tree is copied to /)"
}

install_units() {
    mkdir -p "$UNIT_DIR"
    local unit
    for unit in "$APP.service" "$APP@.service"; do
        install -m 0644 "$REPO_DIR/systemd/$unit" "$UNIT_DIR/$unit"
    done
    say "installed the units into $UNIT_DIR"
    if [[ -f "$REPO_DIR/docs/production.md" ]]; then
        mkdir -p "$OPT_DIR/docs"
        install -m 0644 "$REPO_DIR/docs/production.md" "$OPT_DIR/docs/production.md"
    fi
}

install_env() {
    mkdir -p "$ETC_DIR"
    chmod 0755 "$ETC_DIR"
    install -m 0644 "$SCRIPT_DIR/$APP.env.example" "$ETC_DIR/env.example"
    if [[ -e "$ETC_DIR/env" ]]; then
        say "kept the existing $ETC_DIR/env (compare with env.example after upgrades)"
    else
        install -m 0640 "$SCRIPT_DIR/$APP.env.example" "$ETC_DIR/env"
        say "created $ETC_DIR/env: edit it, then start the service"
    fi
}

install_credentials() {
    mkdir -p "$CRED_DIR"
    chmod 0700 "$CRED_DIR"
    cat > "$CRED_DIR/README" <<README
Secrets for $APP, one file each, readable by root only (mode 0600).

Name a file after the variable it holds, e.g.
    printf '%s' 'postgresql://sokratos_worker:PASSWORD@db.example.org/sokratos' \\
        > $LIVE_CRED_DIR/SOKRATOS_DATABASE_URL
    chmod 0600 $LIVE_CRED_DIR/SOKRATOS_DATABASE_URL
or after the api_key_file / password_file name used in SOKRATOS_LLM_BACKENDS and
SOKRATOS_EMAIL_ACCOUNTS (e.g. "api_key_file": "llm-api-key" -> a file named llm-api-key).

Then run deploy/install.sh again: it writes one LoadCredential= line per file into
/etc/systemd/system/$APP.service.d/credentials.conf (and the same for $APP@.service),
and systemd hands the files to the worker in \$CREDENTIALS_DIRECTORY when it starts.
A trailing newline is removed. This README itself is never passed on.
README
    chmod 0600 "$CRED_DIR/README"

    local lines="" file name
    for file in "$CRED_DIR"/*; do
        [[ -f "$file" ]] || continue
        name=$(basename "$file")
        [[ "$name" == README ]] && continue
        if [[ ! "$name" =~ ^[A-Za-z0-9_][A-Za-z0-9_.@-]*$ ]]; then
            say "skipped credential $name: not a valid credential name"
            continue
        fi
        chmod 0600 "$file"
        lines+="LoadCredential=$name:$LIVE_CRED_DIR/$name"$'\n'
    done

    local unit dropin
    for unit in "$APP.service" "$APP@.service"; do
        dropin="$UNIT_DIR/$unit.d"
        mkdir -p "$dropin"
        {
            echo "# Generated by deploy/install.sh from the files in $LIVE_CRED_DIR;"
            echo "# re-run it after adding or removing a secret. Do not edit."
            echo "[Service]"
            printf '%s' "$lines"
        } > "$dropin/credentials.conf.tmp"
        chmod 0644 "$dropin/credentials.conf.tmp"
        mv -f "$dropin/credentials.conf.tmp" "$dropin/credentials.conf"
    done
    local count
    count=$(printf '%s' "$lines" | grep -c . || true)
    say "credentials: $count file(s) in $CRED_DIR passed with LoadCredential="
}

reload_systemd() {
    if [[ -n "$PREFIX" ]]; then
        say "--prefix given: not calling systemctl"
    elif [[ -d /run/systemd/system ]] && command -v systemctl >/dev/null 2>&1; then
        systemctl daemon-reload
        say "systemd reloaded"
    else
        say "systemd is not running here: skipped 'systemctl daemon-reload'"
    fi
}

if [[ $SKIP_VENV -eq 0 ]]; then
    install_venv
else
    say "--skip-venv: left $VENV alone"
fi
install_units
install_env
install_credentials
reload_systemd

# roles.sql as installed: inside the wheel, or sql/ of a checkout (a path relative to the
# operator's directory named nothing after an install from a wheel or a requirement).
ROLES_SQL_OF='from sokratos_worker.store.migrations import sql_directory; print(sql_directory() / "roles.sql")'
ROLES_SQL=$("$VENV/bin/python" -c "$ROLES_SQL_OF" 2>/dev/null) || true
[[ -f "$ROLES_SQL" ]] || ROLES_SQL="$REPO_DIR/sql/roles.sql"
# Step 2 runs on the target system, where a staged tree's paths have no prefix (the staged
# launcher's #! line names /opt/... already: run by its staged path it failed).
ON_TARGET=""
if [[ -n "$PREFIX" ]]; then
    ON_TARGET=" once the tree is copied to /"
    if [[ "$ROLES_SQL" == "$PREFIX"/* ]]; then
        ROLES_SQL=${ROLES_SQL#"$PREFIX"}
    else
        # No staged venv (--skip-venv): the file is in the target's venv, which says where
        # (this machine's checkout is not on the target).
        ROLES_SQL="\$($LIVE_VENV/bin/python -I -c '$ROLES_SQL_OF')"
    fi
fi

cat <<NEXT
install.sh: done. Next:
  1. edit $ETC_DIR/env (and put secrets into $CRED_DIR, then run this script again);
  2. with an external PostgreSQL: migrate as the role that owns the tables, then create the
     least-privilege roles (roles.sql needs the migrated schema)$ON_TARGET:
       SOKRATOS_DATABASE_URL='postgresql://OWNER@HOST/DB' $LIVE_VENV/bin/$APP migrate
       psql 'postgresql://OWNER@HOST/DB' -v ON_ERROR_STOP=1 -f "$ROLES_SQL"
     (with the embedded PostgreSQL the service migrates its own database: skip this step);
  3. check with the service's configuration ('$APP check', run as docs/production.md §8
     shows), then start:
       systemctl start $APP && systemctl status $APP
     or several workers on this host: systemctl start $APP@a $APP@b
  See docs/production.md.
NEXT
