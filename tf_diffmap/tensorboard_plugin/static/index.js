// The Staleness tab of tf_diffmap: TensorBoard imports this module in an
// iframe and calls render(). Data comes from this plugin's own routes
// (relative URLs: the page's base is /data/plugin/staleness/).

import {
  ALL_COLOR,
  formatNumber,
  h,
  heatLegend,
  heatMap,
  lineChart,
  replicaColor,
  shareBars,
} from "./charts.js";

const REFRESH_SECONDS = 30;

// The series the line chart can show: [key in the data, menu label, y label].
const METRICS = [
  ["staleness/mean", "Mean staleness", "mean staleness"],
  ["staleness/max", "Largest staleness", "largest staleness"],
  ["work/updates", "Updates applied", "updates per point"],
  ["work/share", "Share of the work", "share of the updates computed"],
  ["work/examples_per_second", "Examples per second", "examples / s"],
  ["work/lost", "Replicas lost", "lost (1) or not (0)"],
  ["rule/dropped", "Dropped updates", "dropped updates"],
  ["rule/lr_scale", "Learning-rate scale", "learning-rate factor"],
  ["store/gradients_per_step", "Gradients per optimizer step", "shard gradients per step"],
];

// The units staleness is counted in: versions (updates claimed by others
// between a gradient's read and its push), and, where the store aggregates
// gradients into optimizer steps, the steps applied in between.
const UNITS = {
  versions: { label: "versions", unseen: "updates the gradient did not see" },
  steps: { label: "optimizer steps", unseen: "optimizer steps the gradient did not see" },
};

// Each staleness series in versions, and the same in optimizer steps.
const IN_STEPS = {
  "staleness/mean": "staleness/steps/mean",
  "staleness/max": "staleness/steps/max",
};

async function getJson(path) {
  const response = await fetch(path, { headers: { Accept: "application/json" } });
  if (!response.ok) {
    const detail = (await response.text()).trim();
    throw new Error(`${path}: HTTP ${response.status}${detail ? ` (${detail})` : ""}`);
  }
  return response.json();
}

function shortDevice(device) {
  const match = /device:([A-Za-z]+:\d+)$/.exec(device || "");
  return match ? match[1] : device || "";
}

function replicaLabel(key) {
  if (key === "store") return "the store";
  return key === "all" ? "all replicas" : `replica ${key}`;
}

function colorOf(key) {
  return key === "all" || key === "store" ? ALL_COLOR : replicaColor(Number(key));
}

function sum(values) {
  return values.reduce((a, b) => a + b, 0);
}

class StalenessApp {
  constructor(root) {
    this.root = root;
    this.runs = [];
    // A page of its own can name its run and the staleness unit:
    // index.html?run=NAME&unit=steps.
    const query = new URLSearchParams(window.location.search);
    this.run = query.get("run");
    // The unit chosen; a run without the staleness in steps shows versions.
    this.unit = query.get("unit") === "steps" ? "steps" : "versions";
    this.data = null;
    this.metric = METRICS[0][0];
    this.heatReplica = "all";
    this.hidden = new Set();
    this.chart = null;
  }

  async start() {
    this.root.replaceChildren(this.header(), (this.body = h("main", { class: "content" })));
    await this.load();
    let width = window.innerWidth;
    window.addEventListener("resize", () => {
      if (Math.abs(window.innerWidth - width) < 8 || !this.data) return;
      width = window.innerWidth;
      clearTimeout(this.resizeTimer);
      this.resizeTimer = setTimeout(() => this.draw(), 150);
    });
    setInterval(() => {
      if (document.visibilityState === "visible") this.load({ quiet: true });
    }, REFRESH_SECONDS * 1000);
  }

  header() {
    this.runSelect = h("select", {
      "aria-label": "run",
      onchange: () => {
        this.run = this.runSelect.value;
        // Another run may have other replicas: start from all of them.
        this.heatReplica = "all";
        this.hidden.clear();
        this.load();
      },
    });
    this.updated = h("span", { class: "updated" });
    this.unitSwitch = h(
      "span",
      { class: "unit-switch", role: "group", "aria-label": "staleness unit", hidden: true },
      "staleness in",
      Object.entries(UNITS).map(([unit, { label }]) =>
        h("button", { type: "button", "data-unit": unit, onclick: () => this.setUnit(unit), text: label }),
      ),
    );
    return h(
      "header",
      { class: "app-header" },
      h("h1", { text: "Staleness" }),
      h("span", {
        class: "subtitle",
        text: "asynchronous training with tf_diffmap: how stale each replica's updates were, and who did the work",
      }),
      h(
        "div",
        { class: "controls" },
        this.updated,
        this.unitSwitch,
        h("label", {}, "run ", this.runSelect),
        h("button", { type: "button", onclick: () => this.load(), text: "Reload" }),
      ),
    );
  }

  async load({ quiet = false } = {}) {
    try {
      const { runs } = await getJson("runs");
      this.runs = runs;
      this.runSelect.parentElement.hidden = runs.length < 2;
      if (runs.length === 0) {
        this.data = null;
        this.showMessage(
          "No staleness data in this log directory yet.",
          "Add tf_diffmap.StalenessTensorBoard(log_dir) to the callbacks of model.fit, " +
            "and point tensorboard --logdir at the same directory.",
        );
        return;
      }
      if (!runs.some((r) => r.run === this.run)) {
        // The run written to most recently: the one training now, if any.
        this.run = runs.reduce((a, b) => (b.last_wall_time > a.last_wall_time ? b : a)).run;
      }
      this.runSelect.replaceChildren(
        ...runs.map((r) => h("option", { value: r.run, selected: r.run === this.run, text: r.run })),
      );
      const [series, heat] = await Promise.all([
        getJson(`series?run=${encodeURIComponent(this.run)}`),
        getJson(this.heatUrl(this.unit)),
      ]);
      this.data = series;
      // A run without the staleness in steps (written before it was, or
      // by a store that takes a step per update) shows versions.
      this.heat = heat.unit === this.shownUnit() ? heat : await getJson(this.heatUrl(this.shownUnit()));
      this.updated.textContent = `updated ${new Date().toLocaleTimeString()}`;
      this.draw();
    } catch (error) {
      if (quiet && this.data) return; // keep what is on screen; the next refresh retries
      this.data = null;
      this.showMessage("Could not load the staleness data.", String(error.message || error), true);
    }
  }

  heatUrl(unit) {
    const run = encodeURIComponent(this.run);
    return `heatmap?run=${run}&replica=${encodeURIComponent(this.heatReplica)}&unit=${unit}`;
  }

  // Whether the run counts staleness in optimizer steps too.
  hasSteps() {
    return Boolean(this.data && this.data.series[IN_STEPS["staleness/mean"]]);
  }

  shownUnit() {
    return this.hasSteps() ? this.unit : "versions";
  }

  // The data key of a series in the unit shown.
  unitKey(key) {
    return this.shownUnit() === "steps" && IN_STEPS[key] ? IN_STEPS[key] : key;
  }

  // A line chart's series by key (replicas, "all", or "store"), or null.
  seriesData(key) {
    if (key === "store/gradients_per_step") {
      const points = this.data.gradients_per_step || [];
      return points.length ? { store: points } : null;
    }
    return this.data.series[this.unitKey(key)] || null;
  }

  async setUnit(unit) {
    if (unit === this.unit || !this.data) return;
    this.unit = unit;
    try {
      this.heat = await getJson(this.heatUrl(this.shownUnit()));
      this.draw();
    } catch (error) {
      this.showMessage("Could not load the heat map.", String(error.message || error), true);
    }
  }

  showMessage(title, detail, isError = false) {
    this.body.replaceChildren(
      h(
        "div",
        { class: isError ? "message error" : "message", role: isError ? "alert" : "status" },
        h("strong", { text: title }),
        h("div", { text: detail }),
      ),
    );
  }

  draw() {
    const { info } = this.data;
    this.keys = [...Array(info.num_replicas).keys()].map(String).concat(["all"]);
    this.unitSwitch.hidden = !this.hasSteps();
    for (const button of this.unitSwitch.querySelectorAll("button")) {
      button.setAttribute("aria-pressed", String(button.dataset.unit === this.shownUnit()));
    }
    const available = METRICS.filter(([key]) => this.seriesData(key));
    if (!available.some(([key]) => key === this.metric)) this.metric = available[0]?.[0];

    this.lineBox = h("div", { class: "line-box" });
    this.legendBox = h("div", { class: "legend" });
    this.heatBox = h("div", { class: "heat-box" });
    this.barsBox = h("div", { class: "bars-box" });
    const metricSelect = h(
      "select",
      {
        "aria-label": "series",
        onchange: () => {
          this.metric = metricSelect.value;
          this.drawLines();
        },
      },
      available.map(([key, label]) => h("option", { value: key, selected: key === this.metric, text: label })),
    );
    const heatSelect = h(
      "select",
      {
        "aria-label": "replica",
        onchange: async () => {
          this.heatReplica = heatSelect.value;
          try {
            this.heat = await getJson(this.heatUrl(this.shownUnit()));
            this.drawHeat();
          } catch (error) {
            this.showMessage("Could not load the heat map.", String(error.message || error), true);
          }
        },
      },
      this.keys
        .slice()
        .reverse()
        .map((key) =>
          h("option", {
            value: key,
            selected: key === this.heatReplica,
            text: key === "all" ? "all replicas" : `replica ${key} (${shortDevice(info.devices[key])})`,
          }),
        ),
    );
    const stepUnit = info.step_unit === "epoch" ? "epoch" : "batch";
    this.body.replaceChildren(
      this.cards(),
      h(
        "div",
        { class: "grid" },
        h(
          "section",
          { class: "panel wide", id: "over-time" },
          h(
            "div",
            { class: "panel-head" },
            h("h2", { text: "Staleness over time, per replica" }),
            h("span", { class: "spacer" }),
            metricSelect,
          ),
          this.lineBox,
          this.legendBox,
          h("p", {
            class: "note",
            text: `One point per ${stepUnit === "epoch" ? "epoch" : "interval of batches"}, covering the updates applied since the previous point. Hover a replica to pick out its line; click to hide it.`,
          }),
        ),
        h(
          "section",
          { class: "panel", id: "distribution" },
          h(
            "div",
            { class: "panel-head" },
            h("h2", { text: "Staleness distribution over time" }),
            h("span", { class: "spacer" }),
            heatSelect,
          ),
          this.heatBox,
          heatLegend(),
        ),
        h(
          "section",
          { class: "panel", id: "work" },
          h("div", { class: "panel-head" }, h("h2", { text: "Work share per replica" })),
          this.barsBox,
          h("h3", { text: "Share of the work so far, over time" }),
          (this.shareBox = h("div", { class: "share-box" })),
          h("p", {
            class: "note",
            text: "Shares of the updates computed (applied or dropped) since training began; the dashed lines mark an even share.",
          }),
        ),
      ),
    );
    this.drawLines();
    this.drawHeat();
    this.drawBars();
  }

  cards() {
    const { info, totals, version } = this.data;
    const cards = [];
    const card = (label, value, detail, warn = false, unit = null) =>
      cards.push(
        h(
          "div",
          { class: warn ? "card warn" : "card" },
          h("div", { class: "label", text: label }),
          h("div", { class: "value" }, value, unit ? h("span", { class: "unit", text: unit }) : null),
          detail ? h("div", { class: "detail", text: detail, title: detail }) : null,
        ),
      );
    const devices = [...new Set(info.devices.map(shortDevice))];
    card("Replicas", String(info.num_replicas), devices.join(", "));
    const lastVersion = version.length ? version[version.length - 1][1] : null;
    card("Store version", formatNumber(lastVersion), `at ${info.step_unit} ${version.length ? version[version.length - 1][0] : "–"}`);
    const steps = this.data.optimizer_steps || [];
    if (steps.length) {
      // Over the store's life, as its version: pushes per step applied.
      const applied = steps[steps.length - 1][1];
      const each = applied && lastVersion !== null ? ` · ${(lastVersion / applied).toFixed(1)} gradients each` : "";
      card(
        "Optimizer steps",
        formatNumber(applied),
        (info.gradients_per_step ? `K = ${info.gradients_per_step}` : "aggregated") + each,
      );
    }
    if (totals) {
      const updates = sum(totals.updates);
      card("Updates applied", formatNumber(updates), "since training began");
      // The staleness in the unit shown, the other unit beside it.
      const inSteps = this.hasSteps() && totals.step_staleness_sum !== undefined;
      const figures = (unit) => {
        const sums = unit === "steps" ? totals.step_staleness_sum : totals.staleness_sum;
        const largest = unit === "steps" ? totals.step_staleness_max : totals.staleness_max;
        return { mean: updates ? sum(sums) / updates : 0, largest: Math.max(...largest), maxima: largest };
      };
      const unit = inSteps ? this.shownUnit() : "versions";
      const other = unit === "steps" ? "versions" : "steps";
      const shown = figures(unit);
      const beside = inSteps ? figures(other) : null;
      const bounded = (value) =>
        value >= info.histogram_bins - 1 ? `≥${info.histogram_bins - 1}` : formatNumber(value);
      // Where the run has both units, each figure names its unit.
      const unitLabel = beside ? UNITS[unit].label : null;
      card(
        "Mean staleness",
        shown.mean.toFixed(2),
        beside ? `${beside.mean.toFixed(2)} ${UNITS[other].label}` : UNITS[unit].unseen,
        false,
        unitLabel,
      );
      const where = `replica ${shown.maxima.indexOf(shown.largest)}`;
      // The distribution's largest: dropped gradients included, where
      // strategy.statistics() prints the largest of the applied ones.
      card(
        "Largest staleness (dropped included)",
        bounded(shown.largest),
        beside ? `${where} · ${bounded(beside.largest)} ${UNITS[other].label}` : where,
        false,
        unitLabel,
      );
      const work = totals.updates.map((u, r) => u + totals.dropped[r]);
      const computed = sum(work);
      if (computed && info.num_replicas > 1) {
        const shares = work.map((w) => w / computed);
        const slowest = shares.indexOf(Math.min(...shares));
        const even = 1 / info.num_replicas;
        card(
          "Smallest share",
          `${(100 * shares[slowest]).toFixed(1)}%`,
          `replica ${slowest} (an even share is ${(100 * even).toFixed(1)}%)`,
          shares[slowest] < even / 2,
        );
      }
      const dropped = sum(totals.dropped);
      // Without a rule, only the strategy's bound on the staleness in optimizer steps drops.
      const why = info.rule ? `rule: ${info.rule}` : info.gradients_per_step ? "staler than max_step_staleness steps" : "";
      if (info.rule || dropped) card("Dropped updates", formatNumber(dropped), why, dropped > 0);
    }
    const { now, ever } = this.lostReplicas();
    if (ever.length) {
      const names = (list) => list.map((r) => `${r} (${shortDevice(info.devices[r])})`).join(", ");
      card(
        "Replicas lost",
        String(now.length),
        now.length ? `now: replica ${names(now)}` : `earlier: replica ${names(ever)}; all back`,
        now.length > 0,
      );
    }
    return h("section", { class: "cards" }, cards);
  }

  // Replicas lost at the latest point, and at any point of the run.
  lostReplicas() {
    const lost = this.data.series["work/lost"] || {};
    const now = [];
    const ever = [];
    for (const [key, points] of Object.entries(lost)) {
      if (key === "all" || !points.length) continue;
      if (points.some(([, value]) => value > 0)) ever.push(Number(key));
      if (points[points.length - 1][1] > 0) now.push(Number(key));
    }
    return { now: now.sort((a, b) => a - b), ever: ever.sort((a, b) => a - b) };
  }

  drawLines() {
    const metric = METRICS.find(([key]) => key === this.metric);
    const data = this.seriesData(this.metric) || {};
    const lostNow = new Set(this.lostReplicas().now.map(String));
    const series = [...this.keys, "store"]
      .filter((key) => data[key])
      .map((key) => ({
        key,
        label: replicaLabel(key) + (lostNow.has(key) ? " · lost" : ""),
        color: colorOf(key),
        points: data[key],
        dashed: key === "all",
        width: key === "all" ? 2.2 : 1.6,
      }));
    const percent = this.metric === "work/share";
    // Where the run has both units, a staleness chart names its own.
    const unit = this.hasSteps() && IN_STEPS[this.metric] ? ` (${UNITS[this.shownUnit()].label})` : "";
    this.chart = lineChart(this.lineBox, {
      name: "over-time",
      series,
      hidden: this.hidden,
      xLabel: this.data.info.step_unit,
      yLabel: metric ? metric[2] + unit : "",
      title: metric ? metric[1] + unit : "",
      height: 290,
      integerY: this.metric === "staleness/max" || this.metric === "work/updates",
      yFormat: percent ? (v) => `${(100 * v).toFixed(0)}%` : undefined,
    });
    this.drawLegend(series);
  }

  drawLegend(series) {
    const { info } = this.data;
    this.legendBox.replaceChildren(
      ...series.map((s) => {
        const item = h(
          "span",
          {
            class: this.hidden.has(s.key) ? "legend-item off" : "legend-item",
            role: "button",
            tabindex: 0,
            title: "click to show or hide",
            onmouseenter: () => this.chart.highlight(s.key),
            onmouseleave: () => this.chart.highlight(null),
            onclick: () => {
              if (this.hidden.has(s.key)) this.hidden.delete(s.key);
              else this.hidden.add(s.key);
              item.classList.toggle("off", this.hidden.has(s.key));
              this.chart.setHidden(this.hidden);
            },
          },
          h("span", {
            class: "swatch",
            style: s.dashed
              ? `background:repeating-linear-gradient(90deg,${s.color} 0 5px,transparent 5px 8px)`
              : `background:${s.color}`,
          }),
          s.label,
          info.devices[s.key] ? h("span", { class: "device", text: shortDevice(info.devices[s.key]) }) : null,
        );
        return item;
      }),
    );
  }

  drawHeat() {
    heatMap(this.heatBox, {
      steps: this.heat.steps,
      counts: this.heat.counts,
      overflow: this.heat.overflow,
      xLabel: this.data.info.step_unit,
      unit: this.hasSteps() ? UNITS[this.heat.unit].label : null,
      height: 270,
    });
  }

  drawBars() {
    const { info, totals } = this.data;
    if (!totals) {
      this.barsBox.replaceChildren(h("div", { class: "empty-chart", text: "No points yet." }));
      return;
    }
    // A replica's work: the updates it computed, applied or dropped.
    const work = totals.updates.map((u, r) => u + totals.dropped[r]);
    const computed = sum(work);
    const even = 1 / info.num_replicas;
    const inSteps = this.shownUnit() === "steps" && totals.step_staleness_sum !== undefined;
    const sums = inSteps ? totals.step_staleness_sum : totals.staleness_sum;
    const rows = totals.updates.map((count, r) => {
      const share = computed ? work[r] / computed : 0;
      const mean = count ? sums[r] / count : null;
      return {
        label: `replica ${r}`,
        device: shortDevice(info.devices[r]),
        color: replicaColor(r),
        share,
        text: [
          h("strong", { text: `${(100 * share).toFixed(1)}%` }),
          ` · ${formatNumber(count)} updates · mean staleness ${mean === null ? "–" : mean.toFixed(2)}`,
          this.hasSteps() ? ` ${inSteps ? "steps" : "versions"}` : "",
          totals.dropped[r] ? ` · ${formatNumber(totals.dropped[r])} dropped` : "",
        ],
        badge: info.num_replicas > 1 && share < even / 2 ? "straggler" : null,
      };
    });
    shareBars(this.barsBox, rows, even);
    this.drawShareOverTime(even);
  }

  // Each replica's share of the updates computed (applied or dropped) up to
  // each point.
  drawShareOverTime(even) {
    const applied = this.data.series["work/updates"] || {};
    const dropped = this.data.series["rule/dropped"] || {};
    const keys = Object.keys(applied).filter((key) => key !== "all");
    const steps = [...new Set(keys.flatMap((key) => applied[key].map((p) => p[0])))].sort((a, b) => a - b);
    const running = new Map(keys.map((key) => [key, 0]));
    const at = new Map(
      keys.map((key) => {
        const counts = new Map(applied[key]);
        for (const [step, value] of dropped[key] || []) counts.set(step, (counts.get(step) || 0) + value);
        return [key, counts];
      }),
    );
    const series = new Map(keys.map((key) => [key, []]));
    for (const step of steps) {
      for (const key of keys) running.set(key, running.get(key) + (at.get(key).get(step) || 0));
      const total = sum([...running.values()]);
      if (!total) continue;
      for (const key of keys) series.get(key).push([step, running.get(key) / total]);
    }
    lineChart(this.shareBox, {
      name: "share-over-time",
      series: keys.map((key) => ({
        key,
        label: replicaLabel(key),
        color: colorOf(key),
        points: series.get(key),
      })),
      hidden: this.hidden,
      xLabel: this.data.info.step_unit,
      yLabel: "share",
      title: "Share of the work so far",
      height: 170,
      reference: even,
      yFormat: (v) => `${(100 * v).toFixed(0)}%`,
    });
  }
}

function ensureStyles() {
  if (document.querySelector("link[data-staleness-style]")) return;
  document.head.append(
    h("link", { rel: "stylesheet", href: new URL("./style.css", import.meta.url).href, "data-staleness-style": true }),
  );
}

/** Entry point: TensorBoard calls this once the module is loaded. */
export async function render() {
  ensureStyles();
  let root = document.getElementById("staleness-app");
  if (!root) {
    root = h("div", { id: "staleness-app", class: "staleness-app" });
    document.body.append(root);
  }
  await new StalenessApp(root).start();
}

// index.html (the tab as a page of its own) asks for rendering this way;
// inside TensorBoard, its loader calls render() itself.
if (document.body && document.body.dataset.autorender === "true") {
  render();
}
