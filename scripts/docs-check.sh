#!/usr/bin/env bash
# The built site (make docs first), checked page by page: scripts/check_site.py (every list rendered as a list, no
# source-comment pointers on the user pages), then a screenshot of every page in headless Chromium, for a look
# (installed with apt-get when missing and run as root).
#   bash scripts/docs-check.sh        -> site/shots/<page>.png
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
"$python" scripts/check_site.py site
find_browser() { command -v chromium || command -v chromium-browser || command -v google-chrome || true; }
browser=$(find_browser)
if [ -z "$browser" ] && [ "$(id -u)" = 0 ] && command -v apt-get > /dev/null; then  # a fresh Debian machine
  apt-get update -qq > /dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium > /dev/null
  browser=$(find_browser)
fi
if [ -z "$browser" ]; then
  echo "no Chromium found: apt-get install chromium (Debian), then run make docs-check again" >&2
  exit 2
fi
mkdir -p site/shots
count=0
while IFS= read -r page; do
  rel=${page#site/}
  name=$(dirname "$rel" | tr '/' '-'); [ "$name" = "." ] && name=home
  "$browser" --headless --no-sandbox --disable-gpu --hide-scrollbars --window-size=1280,1600 \
    --screenshot="site/shots/$name.png" "file://$PWD/$page" > /dev/null 2>&1
  [ -s "site/shots/$name.png" ] || { echo "no screenshot of $rel" >&2; exit 1; }
  count=$((count + 1))
done < <(find site -name index.html -not -path "site/shots/*" | sort)
echo "$count pages rendered into site/shots/"
