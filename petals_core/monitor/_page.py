"""The monitor's web page: one HTML document with its style and script inline (the machine may
have no internet, so nothing is fetched from elsewhere).

The script opens an ``EventSource`` on ``api/v1/events`` and redraws the page from each state
event: per model a bar of one cell per block (the number of online servers in it that answer
the monitor, coloured; a hole in red) and a table of its servers.  When the stream breaks for
good (an answer that is not an event stream), it opens a new one a few seconds later.

Everything peers announce (names, versions) is put in the page as text, never as markup, and
the Content-Security-Policy admits only this script and this style (by their hashes), so
nothing a peer announces can run in the page.
"""

from __future__ import annotations

import base64
import hashlib
from typing import Final

__all__ = ["CONTENT_SECURITY_POLICY", "PAGE"]

_STYLE: Final = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #1f2328; }
header { display: flex; align-items: baseline; gap: 1em; }
h1 { font-size: 1.4em; margin: 0 0 0.5em; }
h2 { font-size: 1.15em; margin: 1.2em 0 0.2em; font-family: ui-monospace, monospace; }
.status { padding: 0.1em 0.6em; border-radius: 1em; background: #ddd; }
.status.live { background: #b7e4c7; }
.status.down { background: #f4c7c3; }
.facts, #updated, .legend { color: #57606a; }
.bar { display: flex; flex-wrap: wrap; gap: 2px; margin: 0.5em 0; }
.cell { flex: 1 0 1.6em; max-width: 3em; height: 2em; line-height: 2em; text-align: center;
        border-radius: 3px; font-weight: 600; font-size: 0.85em; }
.hole { background: #d1242f; color: #fff; }
.c1 { background: #f2cc60; }
.c2 { background: #8ddb8c; }
.c3 { background: #2da44e; color: #fff; }
.joining { background: repeating-linear-gradient(45deg, #ccc, #ccc 4px, #eee 4px, #eee 8px); }
.legend .cell { display: inline-block; width: 2.2em; margin: 0 0.3em 0 1em;
                vertical-align: middle; }
table { border-collapse: collapse; margin-top: 0.5em; }
th, td { padding: 0.25em 0.8em; border-bottom: 1px solid #d0d7de; text-align: left; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
.mono { font-family: ui-monospace, monospace; }
.unreachable, .reported { color: #d1242f; font-weight: 600; }
"""

_SCRIPT: Final = """
"use strict";
const models = document.getElementById("models");
const status = document.getElementById("status");
const updated = document.getElementById("updated");

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined && text !== null) node.textContent = String(text);
  return node;
}

function rate(value) {
  if (value >= 10) return value.toFixed(0);
  if (value >= 1) return value.toFixed(1);
  return value > 0 ? value.toPrecision(2) : "0";
}

function cellClass(block) {
  if (block.online >= 3) return "cell c3";
  if (block.online > 0) return "cell c" + block.online;
  return block.joining > 0 ? "cell joining" : "cell hole";
}

function rtt(server) {
  if (server.reachable === null) return "measuring…";
  return server.reachable ? server.rtt_ms.toFixed(1) + " ms" : "unreachable";
}

const REACH = {
  public: "direct",
  cone: "NAT (punched or relayed)",
  symmetric: "NAT (relayed)",
  unknown: "not checked",
};

function reach(server) {
  const text = REACH[server.reachability] || "—";
  return server.relay ? text + ", relays" : text;
}

function reports(server) {
  if (server.reports === 0) return el("td", "num", "—");
  const cell = el("td", "num reported", server.reports + " upheld");
  cell.title = server.report;
  return cell;
}

function serverRow(server) {
  const row = el("tr");
  row.dataset.peerId = server.peer_id;
  const peer = el("td", "mono", server.short_id);
  peer.title = server.peer_id;
  const cells = [
    peer,
    el("td", null, server.public_name || "—"),
    el("td", "num", server.start_block + ":" + server.end_block),
    el("td", null, server.state),
    el("td", "num", rate(server.throughput)),
    el("td", "num", server.cache_tokens_left === null ? "—"
      : server.cache_tokens_left.toLocaleString("en-US")),
    el("td", null, server.torch_dtype + (server.quant_type === "none" ? ""
      : " / " + server.quant_type)),
    el("td", null, server.version),
    el("td", null, reach(server)),
    el("td", server.reachable === false ? "num unreachable" : "num", rtt(server)),
    reports(server),
  ];
  row.append(...cells);
  return row;
}

function renderModel(model) {
  const section = el("section", "model");
  section.dataset.prefix = model.dht_prefix;
  section.append(el("h2", null, model.dht_prefix));
  const facts = [
    model.repository || "local checkpoint",
    model.model_type || "unknown family",
    model.served_blocks + " of " + model.num_blocks + " blocks served",
    model.servers.length + (model.servers.length === 1 ? " server" : " servers"),
  ];
  if (model.refused_reports > 0) {
    facts.push(model.refused_reports + " fraud report" +
      (model.refused_reports === 1 ? "" : "s") + " refused");
  }
  section.append(el("p", "facts", facts.join(" · ")));
  const bar = el("div", "bar");
  bar.setAttribute("role", "img");
  bar.setAttribute("aria-label", "servers per block of " + model.dht_prefix);
  model.blocks.forEach((block, index) => {
    const cell = el("div", cellClass(block), block.online);
    cell.dataset.block = index;
    cell.dataset.online = block.online;
    cell.dataset.joining = block.joining;
    cell.dataset.unreachable = block.unreachable;
    cell.title = "block " + index + ": " + block.online + " online, " + block.joining +
      " joining, " + block.unreachable + " unreachable";
    bar.append(cell);
  });
  section.append(bar);
  if (model.servers.length === 0) {
    section.append(el("p", "empty", "No server announces this model."));
    return section;
  }
  const table = el("table", "servers");
  const head = el("tr");
  for (const name of ["Peer", "Name", "Blocks", "State", "Throughput (rps)",
                      "Cache tokens left", "Dtype / quant.", "Version", "Reached",
                      "Round trip", "Fraud reports"]) {
    head.append(el("th", null, name));
  }
  const thead = el("thead");
  thead.append(head);
  const body = el("tbody");
  body.append(...model.servers.map(serverRow));
  table.append(thead, body);
  section.append(table);
  return section;
}

function render(state) {
  document.body.dataset.version = state.version;
  updated.textContent = "last change " + new Date(state.updated_at * 1000).toLocaleTimeString();
  models.replaceChildren(...(state.models.length ? state.models.map(renderModel)
    : [el("p", "empty", "No model is announced in the swarm.")]));
}

function listen() {
  const source = new EventSource("api/v1/events");
  source.addEventListener("state", (event) => {
    render(JSON.parse(event.data));
    status.textContent = "live";
    status.className = "status live";
  });
  source.onerror = () => {
    status.textContent = "reconnecting…";
    status.className = "status down";
    // The browser retries by itself unless the answer was not an event stream (a proxy's
    // error page, say): then it gives up, and a new source tries again a little later.
    if (source.readyState === EventSource.CLOSED) setTimeout(listen, 3000);
  };
}
listen();
"""

_LEGEND: Final = (
    '<p class="legend">servers per block:'
    '<span class="cell hole">0</span>a hole'
    '<span class="cell c1">1</span>'
    '<span class="cell c2">2</span>'
    '<span class="cell c3">3+</span>'
    '<span class="cell joining">&nbsp;</span>joining only</p>'
)

PAGE: Final = f"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>Swarm monitor</title>
<style>{_STYLE}</style>
</head>
<body data-version="">
<header><h1>Swarm monitor</h1><span id="status" class="status">connecting…</span>
<span id="updated"></span></header>
{_LEGEND}
<main id="models"><p class="empty">Waiting for the swarm's state…</p></main>
<script>{_SCRIPT}</script>
</body>
</html>
"""


def _sha256(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


#: The page may run its own script, use its own style, and talk to this server only.
CONTENT_SECURITY_POLICY: Final = "; ".join(
    [
        "default-src 'none'",
        f"script-src {_sha256(_SCRIPT)}",
        f"style-src {_sha256(_STYLE)}",
        "connect-src 'self'",
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'none'",
    ]
)
