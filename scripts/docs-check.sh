#!/usr/bin/env bash
# Screenshots of the built site (make docs first): the home page and the API page, rendered by headless Chromium.
#   bash scripts/docs-check.sh        -> site/shots/home.png, site/shots/api.png
set -euo pipefail
cd "$(dirname "$0")/.."
browser=$(command -v chromium || command -v chromium-browser || command -v google-chrome || true)
if [ -z "$browser" ]; then
  echo "no Chromium found: apt-get install chromium (Debian), then run make docs-check again" >&2
  exit 2
fi
mkdir -p site/shots
for page in home:index.html api:api/index.html; do
  name=${page%%:*} path=${page#*:}
  "$browser" --headless --no-sandbox --disable-gpu --hide-scrollbars --window-size=1280,1600 \
    --screenshot="site/shots/$name.png" "file://$PWD/site/$path" > /dev/null 2>&1
  [ -s "site/shots/$name.png" ] || { echo "no screenshot of $path" >&2; exit 1; }
  echo "site/shots/$name.png ($(stat -c %s "site/shots/$name.png") bytes)"
done
