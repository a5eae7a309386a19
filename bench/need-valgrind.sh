# Sourced by the instruction-count benchmarks: makes sure valgrind is there, installing it with
# apt-get when run as root, or says how to get it and exits.
if ! command -v valgrind >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get install -y -q valgrind >/dev/null || { apt-get update -q >/dev/null && apt-get install -y -q valgrind >/dev/null; }
  else
    echo "valgrind is needed (apt-get install valgrind)"; exit 2
  fi
fi
