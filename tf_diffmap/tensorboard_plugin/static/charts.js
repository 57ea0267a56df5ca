// Charts of the Staleness tab: a multi-line chart (SVG), a heat map
// (canvas) and share bars (HTML). No dependencies; nothing is fetched.

const SVG_NS = "http://www.w3.org/2000/svg";

/** Creates an element with attributes and children. */
export function h(tag, attributes = {}, ...children) {
  const element = document.createElement(tag);
  for (const [key, value] of Object.entries(attributes)) {
    if (value === undefined || value === null || value === false) continue;
    if (key === "class") element.className = value;
    else if (key === "text") element.textContent = value;
    else if (key.startsWith("on")) element.addEventListener(key.slice(2), value);
    else element.setAttribute(key, value === true ? "" : value);
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    element.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return element;
}

function svg(tag, attributes = {}) {
  const element = document.createElementNS(SVG_NS, tag);
  for (const [key, value] of Object.entries(attributes)) {
    if (key === "text") element.textContent = value;
    else element.setAttribute(key, value);
  }
  return element;
}

/**
 * Distinct colours for n replicas: hues a golden angle apart, so that
 * neighbouring replica ids never get neighbouring hues, with the lightness
 * alternating to separate the hues that do come close (n up to 16 and more).
 */
export function replicaColor(index) {
  const hue = (index * 137.508 + 210) % 360;
  const lightness = index % 2 === 0 ? 42 : 55;
  const saturation = index % 3 === 2 ? 55 : 70;
  return `hsl(${hue.toFixed(1)}, ${saturation}%, ${lightness}%)`;
}

export const ALL_COLOR = "#202124";

/**
 * About `count` round tick values within [low, high], or, with `cover`,
 * from the last round value at or below `low` to the first at or above `high`.
 */
export function niceTicks(low, high, count = 5, integer = false, cover = false) {
  if (!(high > low)) high = low + 1;
  const raw = (high - low) / Math.max(count, 1);
  const power = Math.pow(10, Math.floor(Math.log10(raw)));
  let step = [1, 2, 2.5, 5, 10].map((m) => m * power).find((s) => s >= raw) || raw;
  if (integer) step = Math.max(1, Math.round(step));
  const ticks = [];
  const first = (cover ? Math.floor(low / step + 1e-9) : Math.ceil(low / step - 1e-9)) * step;
  const last = cover ? Math.ceil(high / step - 1e-9) * step : high;
  for (let value = first; value <= last + step * 1e-9; value += step) {
    ticks.push(Number(value.toPrecision(12)));
  }
  return ticks;
}

export function formatNumber(value, digits = 2) {
  if (value === null || value === undefined || Number.isNaN(value)) return "–";
  const magnitude = Math.abs(value);
  if (magnitude >= 1e6) return (value / 1e6).toFixed(1) + "M";
  if (magnitude >= 1e4) return (value / 1e3).toFixed(1) + "k";
  if (Number.isInteger(value)) return String(value);
  if (magnitude >= 100) return value.toFixed(0);
  return String(Number(value.toFixed(digits)));
}

function linear(domainLow, domainHigh, rangeLow, rangeHigh) {
  const span = domainHigh - domainLow || 1;
  return (value) => rangeLow + ((value - domainLow) / span) * (rangeHigh - rangeLow);
}

function tooltip(container) {
  let box = container.querySelector(":scope > .tooltip");
  if (!box) {
    box = h("div", { class: "tooltip", hidden: true });
    container.append(box);
  }
  return {
    show(x, y, content) {
      box.replaceChildren(...content);
      box.hidden = false;
      const width = box.offsetWidth;
      const left = x + 14 + width > container.clientWidth ? x - 14 - width : x + 14;
      box.style.left = `${Math.max(0, left)}px`;
      box.style.top = `${Math.max(0, y - 10)}px`;
    },
    hide() {
      box.hidden = true;
    },
  };
}

/**
 * A chart of several series over steps.
 *
 * @param {HTMLElement} container where to draw (its content is replaced).
 * @param {object} options
 *   series: [{key, label, color, points: [[step, value]], dashed, width}]
 *   xLabel, yLabel: axis titles; height: pixels; yFormat: value formatter;
 *   name: the svg's data-chart attribute (for tests and styling);
 *   integerY: integer ticks on the y axis; reference: a value to mark
 *   with a dashed line (e.g. an even share).
 * @returns {{highlight(key|null), setHidden(Set)}}
 */
export function lineChart(container, options) {
  const { series, xLabel = "step", yLabel = "", height = 280 } = options;
  const yFormat = options.yFormat || ((v) => formatNumber(v));
  container.replaceChildren();
  container.classList.add("chart");
  const width = Math.max(container.clientWidth || 600, 240);
  const margin = { top: 10, right: 16, bottom: 34, left: 52 };
  const plotWidth = width - margin.left - margin.right;
  const plotHeight = height - margin.top - margin.bottom;
  const hidden = new Set(options.hidden || []);

  const points = series.flatMap((s) => s.points);
  if (points.length === 0) {
    container.append(h("div", { class: "empty-chart", text: "No points yet." }));
    return { highlight() {}, setHidden() {} };
  }
  let xMin = Math.min(...points.map((p) => p[0]));
  let xMax = Math.max(...points.map((p) => p[0]));
  if (xMin === xMax) {
    xMin -= 1;
    xMax += 1;
  }
  const yMax = Math.max(...points.map((p) => p[1]), options.reference ?? 0, 0);
  const yMin = Math.min(...points.map((p) => p[1]), 0);
  const yTicks = niceTicks(yMin, yMax > yMin ? yMax : yMin + 1, 5, options.integerY, true);
  const x = linear(xMin, xMax, 0, plotWidth);
  const y = linear(yTicks[0], yTicks[yTicks.length - 1], plotHeight, 0);

  const root = svg("svg", {
    class: "line-chart",
    width,
    height,
    viewBox: `0 0 ${width} ${height}`,
    role: "img",
    "aria-label": options.title || yLabel,
    "data-chart": options.name || "",
  });
  const plot = svg("g", { transform: `translate(${margin.left},${margin.top})` });
  root.append(plot);

  const axes = svg("g", { class: "axis" });
  for (const tick of yTicks) {
    const ty = y(tick);
    axes.append(svg("line", { class: "grid-line", x1: 0, x2: plotWidth, y1: ty, y2: ty }));
    axes.append(
      svg("text", { x: -6, y: ty + 4, "text-anchor": "end", text: yFormat(tick) }),
    );
  }
  for (const tick of niceTicks(xMin, xMax, Math.max(2, Math.floor(plotWidth / 90)), true)) {
    if (tick < xMin || tick > xMax) continue;
    const tx = x(tick);
    axes.append(svg("line", { x1: tx, x2: tx, y1: plotHeight, y2: plotHeight + 4 }));
    axes.append(
      svg("text", { x: tx, y: plotHeight + 16, "text-anchor": "middle", text: String(tick) }),
    );
  }
  axes.append(svg("line", { x1: 0, x2: plotWidth, y1: plotHeight, y2: plotHeight }));
  plot.append(axes);
  plot.append(
    svg("text", {
      class: "axis-label",
      x: plotWidth / 2,
      y: plotHeight + 30,
      "text-anchor": "middle",
      text: xLabel,
    }),
  );
  plot.append(
    svg("text", {
      class: "axis-label",
      transform: `translate(${-40},${plotHeight / 2}) rotate(-90)`,
      "text-anchor": "middle",
      text: yLabel,
    }),
  );

  if (options.reference !== undefined) {
    const ry = y(options.reference);
    plot.append(
      svg("line", { class: "reference", x1: 0, x2: plotWidth, y1: ry, y2: ry }),
    );
  }

  const paths = new Map();
  for (const s of series) {
    if (s.points.length === 0) continue;
    let d = "";
    s.points.forEach(([px, py], i) => {
      d += `${i ? "L" : "M"}${x(px).toFixed(1)},${y(py).toFixed(1)}`;
    });
    const path = svg("path", {
      class: "series",
      d,
      stroke: s.color,
      "stroke-width": s.width || 1.6,
      "data-key": s.key,
    });
    if (s.dashed) path.setAttribute("stroke-dasharray", "6 4");
    if (hidden.has(s.key)) path.setAttribute("visibility", "hidden");
    plot.append(path);
    // A lone point would draw no line: mark it.
    if (s.points.length === 1) {
      const [px, py] = s.points[0];
      const dot = svg("circle", { cx: x(px), cy: y(py), r: 2.5, fill: s.color });
      plot.append(dot);
    }
    paths.set(s.key, path);
  }

  const guide = svg("line", { class: "guide", y1: 0, y2: plotHeight, visibility: "hidden" });
  plot.append(guide);
  const overlay = svg("rect", {
    width: plotWidth,
    height: plotHeight,
    fill: "transparent",
  });
  plot.append(overlay);
  container.append(root);

  const steps = [...new Set(points.map((p) => p[0]))].sort((a, b) => a - b);
  const tip = tooltip(container);
  overlay.addEventListener("mousemove", (event) => {
    const bounds = overlay.getBoundingClientRect();
    const mx = event.clientX - bounds.left;
    const target = xMin + (mx / plotWidth) * (xMax - xMin);
    let step = steps[0];
    for (const candidate of steps) {
      if (Math.abs(candidate - target) < Math.abs(step - target)) step = candidate;
    }
    guide.setAttribute("x1", x(step));
    guide.setAttribute("x2", x(step));
    guide.setAttribute("visibility", "visible");
    const rows = series
      .filter((s) => !hidden.has(s.key))
      .map((s) => ({ s, point: s.points.find((p) => p[0] === step) }))
      .filter((row) => row.point)
      .sort((a, b) => b.point[1] - a.point[1]);
    const content = [h("div", { text: `${xLabel} ${step}` })];
    for (const { s, point } of rows) {
      content.push(
        h(
          "div",
          {},
          h("span", { class: "swatch", style: `background:${s.color}` }),
          `${s.label}: ${yFormat(point[1])}`,
        ),
      );
    }
    tip.show(margin.left + x(step), event.clientY - container.getBoundingClientRect().top, content);
  });
  overlay.addEventListener("mouseleave", () => {
    guide.setAttribute("visibility", "hidden");
    tip.hide();
  });

  return {
    highlight(key) {
      for (const [k, path] of paths) path.classList.toggle("faded", key !== null && k !== key);
    },
    setHidden(keys) {
      hidden.clear();
      for (const key of keys) hidden.add(key);
      for (const [k, path] of paths) {
        path.setAttribute("visibility", hidden.has(k) ? "hidden" : "visible");
      }
    },
  };
}

// Heat-map colours: from a pale blue for a small share of the updates to a
// deep indigo for all of them (cells with no update stay blank).
const HEAT_STOPS = [
  [0.0, [232, 241, 250]],
  [0.25, [150, 196, 226]],
  [0.5, [72, 146, 199]],
  [0.75, [37, 92, 163]],
  [1.0, [22, 36, 94]],
];

export function heatColor(fraction) {
  // The square root spreads the small shares of a long tail over more shades.
  const t = Math.sqrt(Math.min(Math.max(fraction, 0), 1));
  for (let i = 1; i < HEAT_STOPS.length; i++) {
    const [t1, c1] = HEAT_STOPS[i];
    if (t <= t1) {
      const [t0, c0] = HEAT_STOPS[i - 1];
      const u = (t - t0) / (t1 - t0);
      const c = c0.map((v, j) => Math.round(v + (c1[j] - v) * u));
      return `rgb(${c[0]},${c[1]},${c[2]})`;
    }
  }
  return "rgb(22,36,94)";
}

function canvasFor(width, height, className) {
  const ratio = window.devicePixelRatio || 1;
  const canvas = h("canvas", { class: className });
  canvas.width = Math.round(width * ratio);
  canvas.height = Math.round(height * ratio);
  canvas.style.width = `${width}px`;
  canvas.style.height = `${height}px`;
  const context = canvas.getContext("2d");
  context.scale(ratio, ratio);
  return { canvas, context };
}

/**
 * The staleness distribution over steps: one column per point, one row per
 * staleness, each cell shaded by the share of the column's updates.
 *
 * @param {HTMLElement} container where to draw (its content is replaced).
 * @param {object} options steps, counts (per step, counts of staleness
 *   0, 1, ...), overflow (the staleness whose bin also counts all above),
 *   xLabel, height, unit (what the staleness counts, e.g. "optimizer
 *   steps", named on the axis and in the tooltip; none by default).
 */
export function heatMap(container, options) {
  const { steps, counts, overflow, xLabel = "step", height = 260, unit = null } = options;
  container.replaceChildren();
  container.classList.add("chart");
  if (steps.length === 0) {
    container.append(h("div", { class: "empty-chart", text: "No points yet." }));
    return;
  }
  const width = Math.max(container.clientWidth || 600, 240);
  const margin = { top: 8, right: 12, bottom: 34, left: 52 };
  const plotWidth = width - margin.left - margin.right;
  const plotHeight = height - margin.top - margin.bottom;
  const rows = Math.max(1, ...counts.map((c) => c.length));
  const { canvas, context } = canvasFor(width, height, "heatmap");
  // A point covers the updates since the previous point, so its column
  // spans from the previous step to its own: the x axis is the steps', as in
  // the line chart, however unevenly the points are spaced.
  const firstGap = steps.length > 1 ? steps[1] - steps[0] : 1;
  const xStart = steps[0] - firstGap;
  const xEnd = steps[steps.length - 1];
  const x = linear(xStart, xEnd, margin.left, margin.left + plotWidth);
  const edges = [xStart, ...steps];
  const cellHeight = plotHeight / rows;

  context.fillStyle = "#fafbfc";
  context.fillRect(margin.left, margin.top, plotWidth, plotHeight);
  let cells = 0;
  const means = [];
  counts.forEach((column, j) => {
    const total = column.reduce((a, b) => a + b, 0);
    const left = x(edges[j]);
    const cellWidth = x(edges[j + 1]) - left;
    let weighted = 0;
    column.forEach((count, s) => {
      weighted += count * s;
      if (!count) return;
      context.fillStyle = heatColor(count / total);
      const top = margin.top + plotHeight - (s + 1) * cellHeight;
      // Overlap by a pixel fraction so that thin cells leave no seams.
      context.fillRect(left, top, cellWidth + 0.6, cellHeight + 0.6);
      cells += 1;
    });
    means.push(total ? weighted / total : null);
  });

  // The mean of each column, in the accent colour.
  context.strokeStyle = "#e8710a";
  context.lineWidth = 1.5;
  context.beginPath();
  let drawing = false;
  means.forEach((mean, j) => {
    if (mean === null) {
      drawing = false;
      return;
    }
    const px = (x(edges[j]) + x(edges[j + 1])) / 2;
    const py = margin.top + plotHeight - (mean + 0.5) * cellHeight;
    if (drawing) context.lineTo(px, py);
    else context.moveTo(px, py);
    drawing = true;
  });
  context.stroke();

  // Axes.
  context.fillStyle = "#5f6368";
  context.strokeStyle = "#dadce0";
  context.lineWidth = 1;
  context.font = "11px Roboto, Helvetica Neue, Arial, sans-serif";
  context.textAlign = "right";
  context.textBaseline = "middle";
  for (const tick of niceTicks(0, rows - 1, Math.min(6, rows), true)) {
    if (tick > rows - 1) continue;
    const ty = margin.top + plotHeight - (tick + 0.5) * cellHeight;
    const label = tick >= overflow ? `≥${overflow}` : String(tick);
    context.fillText(label, margin.left - 6, ty);
  }
  context.textAlign = "center";
  context.textBaseline = "top";
  // Few columns: each labelled with its step, in its middle; many: round
  // steps where they fall.
  const labels =
    steps.length <= plotWidth / 40
      ? steps.map((step, j) => [step, (x(edges[j]) + x(edges[j + 1])) / 2])
      : niceTicks(steps[0], xEnd, Math.max(2, Math.floor(plotWidth / 90)), true)
          .filter((tick) => tick >= steps[0] && tick <= xEnd)
          .map((tick) => [tick, x(tick)]);
  for (const [tick, tx] of labels) {
    context.fillText(String(tick), tx, margin.top + plotHeight + 5);
    context.beginPath();
    context.moveTo(tx, margin.top + plotHeight);
    context.lineTo(tx, margin.top + plotHeight + 3);
    context.stroke();
  }
  context.fillText(xLabel, margin.left + plotWidth / 2, margin.top + plotHeight + 19);
  context.save();
  context.translate(14, margin.top + plotHeight / 2);
  context.rotate(-Math.PI / 2);
  context.textBaseline = "middle";
  context.fillText(unit ? `staleness (${unit})` : "staleness", 0, 0);
  context.restore();

  canvas.dataset.columns = String(steps.length);
  canvas.dataset.cells = String(cells);
  if (unit) canvas.dataset.unit = unit;
  container.append(canvas);

  const tip = tooltip(container);
  canvas.addEventListener("mousemove", (event) => {
    const bounds = canvas.getBoundingClientRect();
    const mx = event.clientX - bounds.left;
    const my = event.clientY - bounds.top - margin.top;
    // Column j spans from edges[j] to edges[j + 1].
    const j = edges.findIndex((edge, i) => i > 0 && mx <= x(edge) && mx > x(edges[i - 1])) - 1;
    const s = Math.floor((plotHeight - my) / cellHeight);
    if (j < 0 || j >= steps.length || s < 0 || s >= rows) {
      tip.hide();
      return;
    }
    const column = counts[j];
    const total = column.reduce((a, b) => a + b, 0);
    const count = column[s] || 0;
    const share = total ? ((100 * count) / total).toFixed(1) : "0";
    tip.show(event.clientX - bounds.left, event.clientY - bounds.top, [
      h("div", { text: `${xLabel} ${steps[j]}` }),
      h("div", {
        text: `staleness ${s >= overflow ? "≥" + overflow : s}${unit ? ` ${unit}` : ""}: ${count} updates (${share}%)`,
      }),
      h("div", { text: `mean staleness ${means[j] === null ? "–" : means[j].toFixed(2)}` }),
    ]);
  });
  canvas.addEventListener("mouseleave", () => tip.hide());
}

/** The colour scale of the heat map, as a small legend. */
export function heatLegend() {
  const width = 160;
  const { canvas, context } = canvasFor(width, 10, "heat-legend");
  for (let x = 0; x < width; x++) {
    context.fillStyle = heatColor((x / (width - 1)) ** 2);
    context.fillRect(x, 0, 1.5, 10);
  }
  return h(
    "div",
    { class: "color-scale" },
    "share of the interval's updates: 0",
    canvas,
    "100%",
    h("span", {}, h("span", { class: "swatch-line", text: "—", style: "color:#e8710a" }), " mean"),
  );
}

/**
 * Horizontal bars, one per replica.
 *
 * @param {HTMLElement} container where to draw (its content is replaced).
 * @param {Array} rows [{label, device, color, share, text: [nodes], badge}]
 * @param {number} even the share each replica would have if all were alike.
 */
export function shareBars(container, rows, even) {
  container.replaceChildren();
  const top = Math.max(even * 1.25, ...rows.map((r) => r.share), 1e-9);
  const grid = h("div", { class: "bars" });
  for (const row of rows) {
    const track = h(
      "div",
      { class: "bar-track", title: `${(100 * row.share).toFixed(1)}% of the updates` },
      h("div", {
        class: "bar-fill",
        style: `width:${((100 * row.share) / top).toFixed(2)}%;background:${row.color}`,
      }),
      h("div", { class: "bar-even", style: `left:${((100 * even) / top).toFixed(2)}%` }),
    );
    grid.append(
      h(
        "div",
        { class: "bar-label" },
        row.label,
        row.device ? h("span", { class: "device", text: row.device }) : null,
      ),
      track,
      h("div", { class: "bar-text" }, ...row.text, row.badge ? h("span", { class: "badge", text: row.badge }) : null),
    );
  }
  container.append(grid);
}
