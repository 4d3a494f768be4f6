#!/usr/bin/env bash
# Rebuild ../echarts.custom.min.js from the npm packages pinned in package-lock.json
# (echarts, esbuild): ECharts with only what the report draws (entry.js), minified, as
# one script that defines the global `echarts`, under the Apache header of the package's
# own build. Needs node and npm, and the npm registry; the report never runs this.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out="$here/../echarts.custom.min.js"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp "$here/package.json" "$here/package-lock.json" "$here/entry.js" "$work/"
cd "$work"
npm ci --no-audit --no-fund --ignore-scripts --loglevel=error
banner=$(sed -n '1,/\*\//p' node_modules/echarts/dist/echarts.min.js)
node_modules/.bin/esbuild entry.js --bundle --minify --format=iife --global-name=echarts --target=es2018 \
  --define:process.env.NODE_ENV='"production"' --legal-comments=none --banner:js="$banner" \
  --log-level=warning --outfile="$out"
echo "$(wc -c < "$out") bytes, sha256 $(sha256sum "$out" | cut -d' ' -f1): $out"
