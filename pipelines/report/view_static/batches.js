// overnight serve's batches page: the batches of the key given here, from /v1/batches (the
// same API the clients call, behind the same key). Every value goes in as text, never markup.
"use strict";
const KEY = "overnight-key";
let first = [];  // the newest page, fetched again every few seconds (statuses move)
let older = [];  // the pages after it, fetched by "more"
let after = null;  // where "more" starts; null: nothing more

function text(id, value) { document.getElementById(id).textContent = value; }

function say(message) {
  const p = document.getElementById("problem");
  p.hidden = !message; p.textContent = message || "";
}

async function page(from) {
  const params = new URLSearchParams({limit: "100"});
  if (from) params.set("after", from);
  const response = await fetch(`/v1/batches?${params}`, {
    headers: {Authorization: `Bearer ${sessionStorage.getItem(KEY)}`}});
  const body = await response.json();
  if (!response.ok) throw new Error((body.error || {}).message || `HTTP ${response.status}`);
  return body;
}

function cell(tr, value) {
  const td = document.createElement("td");
  td.textContent = value === null || value === undefined ? "" : String(value);
  tr.appendChild(td);
  return td;
}

function draw() {
  const shown = first.concat(older.filter(b => !first.some(f => f.id === b.id)));
  const tbody = document.querySelector("#batches tbody");
  tbody.replaceChildren(...shown.map(b => {
    const tr = document.createElement("tr");
    const link = document.createElement("a");
    link.href = `/ui/batches/${encodeURIComponent(b.id)}`; link.textContent = b.id;
    cell(tr, "").appendChild(link);
    const counts = b.request_counts || {};
    cell(tr, b.status); cell(tr, b.endpoint);
    cell(tr, new Date(b.created_at * 1000).toISOString().replace(".000", ""));
    cell(tr, counts.total); cell(tr, counts.completed); cell(tr, counts.failed);
    cell(tr, b.metadata ? JSON.stringify(b.metadata) : "");
    tr.addEventListener("click", () => { location.href = link.href; });
    return tr;
  }));
  text("count", `${shown.length} batch${shown.length === 1 ? "" : "es"}, newest first`);
}

async function refresh() {
  if (!sessionStorage.getItem(KEY)) return;
  try {
    const newest = await page(null);
    first = newest.data;
    if (!older.length) after = newest.has_more ? first[first.length - 1].id : null;
    document.getElementById("more").hidden = after === null;
    document.getElementById("list").hidden = false;
    document.getElementById("forget").hidden = false;
    say(null);
    draw();
  } catch (error) {
    document.getElementById("list").hidden = true;
    say(error.message);
  }
}

function reset() { first = []; older = []; after = null; }

document.addEventListener("DOMContentLoaded", () => {
  document.getElementById("key-form").addEventListener("submit", e => {
    e.preventDefault();
    sessionStorage.setItem(KEY, document.getElementById("key").value.trim());
    document.getElementById("key").value = "";
    reset(); refresh();
  });
  document.getElementById("forget").addEventListener("click", () => {
    sessionStorage.removeItem(KEY); reset(); draw();
    document.getElementById("list").hidden = true;
    document.getElementById("forget").hidden = true;
  });
  document.getElementById("more").addEventListener("click", async () => {
    try {
      const next = await page(after);
      older = older.concat(next.data);
      after = next.has_more ? next.data[next.data.length - 1].id : null;
      document.getElementById("more").hidden = after === null;
      draw();
    } catch (error) { say(error.message); }
  });
  refresh();
  setInterval(refresh, 3000);
});
