//! Plots of load runs, as PNG and SVG, drawn with plotters and the embedded DejaVu Sans font
//! (`assets/DejaVuSans.ttf`, registered through plotters' `ab_glyph` support: no system font
//! is needed).
//!
//! [`write_plots`] writes into a directory:
//!
//! - `e2e_latency.png` / `.svg`: the end-to-end latency percentile curve of every run
//!   ([`RunReport::e2e_curve`](crate::load::RunReport)). The x axis is in "nines"
//!   (`−log10(1 − p)`: 50 %, 90 %, 99 %, 99.9 % … equally spaced) and ends with the maximum;
//!   the y axis is milliseconds on a log scale.
//! - for runs that are not a ladder's, `e2e_timeline.png` / `.svg`: the P99 and the maximum
//!   end-to-end latency of the messages intended in each second of sending
//!   ([`RunReport::e2e_timeline`](crate::load::RunReport)), so that a tail shows whether it
//!   is spread over the run or made of a few stalls (drawn when a run has a timeline).
//! - for a ladder, `ladder.png` / `.svg`: left, the rate of each step against its
//!   end-to-end P99 (log scale); right, the rate against mailbox and core Redis CPU %
//!   (mean per instance), with the ρ = 0.65 line. Each point is labelled with its
//!   `mailbox+core` instance counts.
//!
//! An SVG names its font family (`sans-serif`) and leaves glyph rendering to the viewer; the
//! layout (text widths) is computed with the embedded font.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use std::ops::Range;

use plotters::coord::ranged1d::{KeyPointHint, NoDefaultFormatting, ValueFormatter};
use plotters::coord::types::RangedCoordf64;
use plotters::coord::{CoordTranslate, Shift};
use plotters::prelude::*;
use plotters::style::register_font;

use crate::load::{RunReport, TARGET_RHO};

/// The embedded font.
static FONT: &[u8] = include_bytes!("../assets/DejaVuSans.ttf");

/// Size of every figure, pixels.
pub const SIZE: (u32, u32) = (1200, 700);

/// Colours of the series, in order.
const COLORS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
    RGBColor(255, 127, 14),
    RGBColor(23, 190, 207),
];

/// Errors of drawing.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The output directory could not be created.
    #[error("io: {0}")]
    Io(#[from] std::io::Error),
    /// The embedded font could not be loaded.
    #[error("the embedded font could not be loaded")]
    Font,
    /// A backend failed while drawing or writing a file.
    #[error("drawing {path}: {message}")]
    Draw {
        /// The file being drawn.
        path: PathBuf,
        /// The backend's error.
        message: String,
    },
}

impl Error {
    /// A stable, machine-readable code.
    pub fn code(&self) -> &'static str {
        match self {
            Error::Io(_) => "io",
            Error::Font => "font",
            Error::Draw { .. } => "draw",
        }
    }
}

/// Registers the embedded font for every family plotters may ask for (once per process).
fn register_fonts() -> Result<(), Error> {
    static DONE: OnceLock<bool> = OnceLock::new();
    let ok = *DONE.get_or_init(|| {
        ["sans-serif", "serif", "monospace"]
            .iter()
            .all(|family| register_font(family, FontStyle::Normal, FONT).is_ok())
    });
    if ok {
        Ok(())
    } else {
        Err(Error::Font)
    }
}

/// Writes the figures for `runs` into `dir` (created if missing) and returns the files
/// written: always `e2e_latency.{png,svg}`, and `ladder.{png,svg}` when `ladder` is true.
pub fn write_plots(dir: &Path, runs: &[RunReport], ladder: bool) -> Result<Vec<PathBuf>, Error> {
    register_fonts()?;
    std::fs::create_dir_all(dir)?;
    let mut written = Vec::new();
    write_figure(dir, &Latency { runs, ladder }, &mut written)?;
    if ladder {
        write_figure(dir, &Ladder { runs }, &mut written)?;
    } else if runs.iter().any(|r| !r.e2e_timeline.is_empty()) {
        write_figure(dir, &Timeline { runs }, &mut written)?;
    }
    Ok(written)
}

/// A figure, drawn the same way on the PNG and the SVG backend.
trait Figure {
    /// File name without the extension.
    const STEM: &'static str;

    fn draw<DB: DrawingBackend>(&self, root: DrawingArea<DB, Shift>) -> Result<(), String>;
}

/// Draws `figure` as `<STEM>.png`, then `<STEM>.svg`, into `dir`; adds each file to
/// `written` once drawn.
fn write_figure<F: Figure>(
    dir: &Path,
    figure: &F,
    written: &mut Vec<PathBuf>,
) -> Result<(), Error> {
    let failed = |path: &PathBuf| {
        let path = path.clone();
        move |message| Error::Draw { path, message }
    };
    let png = dir.join(format!("{}.png", F::STEM));
    figure
        .draw(BitMapBackend::new(&png, SIZE).into_drawing_area())
        .map_err(failed(&png))?;
    written.push(png);
    let svg = dir.join(format!("{}.svg", F::STEM));
    figure
        .draw(SVGBackend::new(&svg, SIZE).into_drawing_area())
        .map_err(failed(&svg))?;
    written.push(svg);
    Ok(())
}

/// The end-to-end latency percentile curve of every run.
struct Latency<'a> {
    runs: &'a [RunReport],
    ladder: bool,
}

impl Figure for Latency<'_> {
    const STEM: &'static str = "e2e_latency";

    fn draw<DB: DrawingBackend>(&self, root: DrawingArea<DB, Shift>) -> Result<(), String> {
        draw_latency(root, self.runs, self.ladder)
    }
}

/// Each run's per-second P99 and maximum end-to-end latency.
struct Timeline<'a> {
    runs: &'a [RunReport],
}

impl Figure for Timeline<'_> {
    const STEM: &'static str = "e2e_timeline";

    fn draw<DB: DrawingBackend>(&self, root: DrawingArea<DB, Shift>) -> Result<(), String> {
        draw_timeline(root, self.runs)
    }
}

/// The capacity ladder: rate against P99 and against Redis CPU %.
struct Ladder<'a> {
    runs: &'a [RunReport],
}

impl Figure for Ladder<'_> {
    const STEM: &'static str = "ladder";

    fn draw<DB: DrawingBackend>(&self, root: DrawingArea<DB, Shift>) -> Result<(), String> {
        draw_ladder(root, self.runs)
    }
}

/// One series: a line through `points`, a dot on each, and its legend entry `label`.
fn draw_line<'a, DB, CT>(
    chart: &mut ChartContext<'a, DB, CT>,
    points: &[(f64, f64)],
    color: RGBColor,
    label: String,
) -> Result<(), String>
where
    DB: DrawingBackend + 'a,
    CT: CoordTranslate<From = (f64, f64)>,
{
    let e = |e: DrawingAreaErrorKind<DB::ErrorType>| e.to_string();
    chart
        .draw_series(LineSeries::new(points.to_vec(), color.stroke_width(2)))
        .map_err(e)?
        .label(label)
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], color.stroke_width(3)));
    chart
        .draw_series(points.iter().map(|&p| Circle::new(p, 4, color.filled())))
        .map_err(e)?;
    Ok(())
}

/// The legend of a chart's series, upper left on a translucent white box.
fn draw_legend<'a, DB, CT>(
    chart: &mut ChartContext<'a, DB, CT>,
    font_size: u32,
) -> Result<(), String>
where
    DB: DrawingBackend + 'a,
    CT: CoordTranslate,
{
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .label_font(("sans-serif", font_size))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(|e| e.to_string())
}

/// The x coordinate of a percentile: its number of nines; the maximum goes one past the
/// last finite percentile.
fn nines(p: f64) -> f64 {
    if p >= 100.0 {
        MAX_X
    } else {
        -(1.0 - p / 100.0).log10()
    }
}

/// Where the maximum is drawn (99.999 % is at 5).
const MAX_X: f64 = 6.0;

/// The x axis of the latency curve: linear in nines, ticks at 50 %, 90 %, 99 % … and max.
struct NinesAxis(Range<f64>);

impl Ranged for NinesAxis {
    type FormatOption = NoDefaultFormatting;
    type ValueType = f64;

    fn map(&self, v: &f64, limit: (i32, i32)) -> i32 {
        let span = self.0.end - self.0.start;
        let t = (v - self.0.start) / span;
        limit.0 + ((limit.1 - limit.0) as f64 * t).round() as i32
    }

    fn key_points<H: KeyPointHint>(&self, hint: H) -> Vec<f64> {
        if hint.weight().allow_light_points() {
            return Vec::new(); // no light grid lines between the ticks
        }
        vec![nines(50.0), 1.0, 2.0, 3.0, 4.0, 5.0, MAX_X]
    }

    fn range(&self) -> Range<f64> {
        self.0.clone()
    }
}

impl ValueFormatter<f64> for NinesAxis {
    fn format(value: &f64) -> String {
        nines_label(*value)
    }
}

fn nines_label(x: f64) -> String {
    if (x - MAX_X).abs() < 1e-6 {
        return "max".into();
    }
    let p = 100.0 * (1.0 - 10f64.powf(-x));
    let digits = (x.ceil() as i32 - 2).clamp(0, 4) as usize;
    format!("{p:.digits$}%")
}

fn series_label(r: &RunReport, ladder: bool, all: &[RunReport]) -> String {
    if ladder {
        format!(
            "{} @ {}/s ({})",
            r.instances_label(),
            crate::load::group_thousands(r.rate, 0),
            r.layout
        )
    } else if all.iter().filter(|o| o.layout == r.layout).count() > 1 {
        let label = |o: &RunReport| format!("{} {} @ {}/s", o.layout, o.instances_label(), o.rate);
        let mine = label(r);
        let same: Vec<&RunReport> = all.iter().filter(|o| label(o) == mine).collect();
        match same.iter().position(|o| std::ptr::eq(*o, r)) {
            // runs alike in all of that: numbered as the tables number them
            Some(k) if same.len() > 1 => format!("{mine} #{}", k + 1),
            _ => mine,
        }
    } else {
        r.layout.to_string()
    }
}

/// The range of a log axis covering `values` (with some room), never empty or ≤ 0.
fn log_bounds(values: impl Iterator<Item = f64>) -> (f64, f64) {
    let (mut lo, mut hi) = (f64::INFINITY, 0.0f64);
    for v in values.filter(|v| v.is_finite() && *v > 0.0) {
        lo = lo.min(v);
        hi = hi.max(v);
    }
    if !lo.is_finite() {
        return (0.1, 10.0);
    }
    // Whole decades: plotters labels a log axis well only between powers of ten.
    let lo = 10f64.powf((lo * 0.9).max(1e-3).log10().floor());
    let hi = 10f64.powf((hi * 1.1).log10().ceil()).max(lo * 10.0);
    (lo, hi)
}

fn ms_label(y: f64) -> String {
    if y >= 1000.0 {
        crate::load::group_thousands(y, 0)
    } else if y >= 10.0 {
        format!("{y:.0}")
    } else if y >= 1.0 {
        format!("{y:.1}")
    } else {
        format!("{y:.2}")
    }
}

/// A chart of e2e latency: `x` along the bottom (described by `x_desc`), milliseconds from
/// `lo` to `hi` on a log scale up the side, the mesh drawn.
fn ms_chart<'a, DB, X>(
    root: &'a DrawingArea<DB, Shift>,
    caption: String,
    x: X,
    (lo, hi): (f64, f64),
    x_desc: &str,
) -> Result<ChartContext<'a, DB, Cartesian2d<X, LogCoord<f64>>>, String>
where
    DB: DrawingBackend + 'a,
    X: Ranged<ValueType = f64> + ValueFormatter<f64>,
{
    let e = |e: DrawingAreaErrorKind<DB::ErrorType>| e.to_string();
    let mut chart = ChartBuilder::on(root)
        .caption(caption, ("sans-serif", 26))
        .margin(20)
        .x_label_area_size(50)
        .y_label_area_size(80)
        .build_cartesian_2d(x, (lo..hi).log_scale())
        .map_err(e)?;
    chart
        .configure_mesh()
        .x_desc(x_desc)
        .y_desc("milliseconds (intended send → deliver)")
        .y_label_formatter(&|y| ms_label(*y))
        .label_style(("sans-serif", 16))
        .axis_desc_style(("sans-serif", 18))
        .draw()
        .map_err(e)?;
    Ok(chart)
}

fn draw_latency<DB: DrawingBackend>(
    root: DrawingArea<DB, Shift>,
    runs: &[RunReport],
    ladder: bool,
) -> Result<(), String> {
    let e = |e: DrawingAreaErrorKind<DB::ErrorType>| e.to_string();
    root.fill(&WHITE).map_err(e)?;
    let (lo, hi) = log_bounds(runs.iter().flat_map(|r| r.e2e_curve.iter().map(|p| p.1)));
    let caption = match runs.first() {
        Some(r) if !ladder => format!(
            "End-to-end latency: {} clients, {}/s, {} s, {} mailbox + {} core",
            r.clients,
            crate::load::group_thousands(r.rate, 0),
            r.duration_s,
            r.mailbox_instances,
            r.core_instances
        ),
        _ => "End-to-end latency by percentile".into(),
    };
    let mut chart = ms_chart(
        &root,
        caption,
        NinesAxis(0.0..MAX_X + 0.3),
        (lo, hi),
        "percentile",
    )?;
    for (k, r) in runs.iter().enumerate() {
        let color = COLORS[k % COLORS.len()];
        let points: Vec<(f64, f64)> = r
            .e2e_curve
            .iter()
            .map(|&(p, ms)| (nines(p), ms.max(lo)))
            .collect();
        draw_line(&mut chart, &points, color, series_label(r, ladder, runs))?;
    }
    if runs.iter().any(|r| !r.e2e_curve.is_empty()) {
        draw_legend(&mut chart, 16)?;
    }
    root.present().map_err(e)?;
    Ok(())
}

fn draw_timeline<DB: DrawingBackend>(
    root: DrawingArea<DB, Shift>,
    runs: &[RunReport],
) -> Result<(), String> {
    let e = |e: DrawingAreaErrorKind<DB::ErrorType>| e.to_string();
    root.fill(&WHITE).map_err(e)?;
    let (lo, hi) = log_bounds(
        runs.iter()
            .flat_map(|r| r.e2e_timeline.iter().flat_map(|s| [s.p99, s.max])),
    );
    let seconds = runs
        .iter()
        .map(|r| r.e2e_timeline.len())
        .max()
        .unwrap_or(0)
        .max(1) as f64;
    let caption = match runs.first() {
        Some(r) => format!(
            "End-to-end latency by second of sending: {} clients, {}/s",
            r.clients,
            crate::load::group_thousands(r.rate, 0),
        ),
        None => "End-to-end latency by second of sending".into(),
    };
    let mut chart = ms_chart(
        &root,
        caption,
        RangedCoordf64::from(0.0..seconds),
        (lo, hi),
        "second of sending (intended send time)",
    )?;
    for (k, r) in runs.iter().enumerate() {
        let color = COLORS[k % COLORS.len()];
        let label = series_label(r, false, runs);
        let at = |f: fn(&crate::load::SecondLatency) -> f64| -> Vec<(f64, f64)> {
            r.e2e_timeline
                .iter()
                .enumerate()
                .filter(|(_, s)| s.delivered > 0)
                .map(|(i, s)| (i as f64 + 0.5, f(s).max(lo)))
                .collect()
        };
        let pale = color.mix(0.45);
        chart
            .draw_series(LineSeries::new(at(|s| s.max), pale.stroke_width(1)))
            .map_err(e)?
            .label(format!("{label}, max"))
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 24, y)], pale.stroke_width(1))
            });
        draw_line(&mut chart, &at(|s| s.p99), color, format!("{label}, P99"))?;
    }
    if runs.iter().any(|r| !r.e2e_timeline.is_empty()) {
        draw_legend(&mut chart, 16)?;
    }
    root.present().map_err(e)?;
    Ok(())
}

/// A ladder series: [`draw_line`] through its `(rate, y)` points, each labelled with its
/// `M+C` instance counts just above and right of it.
fn draw_ladder_line<'a, DB, CT>(
    chart: &mut ChartContext<'a, DB, CT>,
    pts: &[(f64, f64, String)],
    color: RGBColor,
    label: String,
) -> Result<(), String>
where
    DB: DrawingBackend + 'a,
    CT: CoordTranslate<From = (f64, f64)>,
{
    let line: Vec<(f64, f64)> = pts.iter().map(|p| (p.0, p.1)).collect();
    draw_line(chart, &line, color, label)?;
    chart
        .draw_series(pts.iter().map(|p| {
            EmptyElement::at((p.0, p.1))
                + Text::new(
                    p.2.clone(),
                    (6, -20),
                    ("sans-serif", 14).into_font().color(&BLACK),
                )
        }))
        .map_err(|e| e.to_string())?;
    Ok(())
}

fn draw_ladder<DB: DrawingBackend>(
    root: DrawingArea<DB, Shift>,
    runs: &[RunReport],
) -> Result<(), String> {
    let e = |e: DrawingAreaErrorKind<DB::ErrorType>| e.to_string();
    root.fill(&WHITE).map_err(e)?;
    let root = root
        .titled("Capacity ladder", ("sans-serif", 26))
        .map_err(e)?;
    let (left, right) = root.split_horizontally(SIZE.0 / 2);
    let max_rate = runs.iter().map(|r| r.rate).fold(0.0, f64::max).max(1.0) * 1.1;

    // Series: one per layout, points in run order.
    let mut layouts: Vec<_> = runs.iter().map(|r| r.layout).collect();
    layouts.dedup();
    let mut seen = Vec::new();
    layouts.retain(|l| {
        let new = !seen.contains(l);
        seen.push(*l);
        new
    });

    // Left: rate → e2e P99.
    let (lo, hi) = log_bounds(runs.iter().map(|r| r.e2e_ms.p99));
    let mut chart = ChartBuilder::on(&left)
        .caption("end-to-end P99", ("sans-serif", 20))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(70)
        .build_cartesian_2d(0.0..max_rate, (lo..hi).log_scale())
        .map_err(e)?;
    chart
        .configure_mesh()
        .x_desc("rate (msg/s)")
        .y_desc("ms")
        .x_label_formatter(&|x| crate::load::group_thousands(*x, 0))
        .y_label_formatter(&|y| ms_label(*y))
        .label_style(("sans-serif", 14))
        .axis_desc_style(("sans-serif", 16))
        .draw()
        .map_err(e)?;
    for (k, layout) in layouts.iter().enumerate() {
        let color = COLORS[k % COLORS.len()];
        let pts: Vec<(f64, f64, String)> = runs
            .iter()
            .filter(|r| r.layout == *layout)
            .map(|r| (r.rate, r.e2e_ms.p99.max(lo), r.instances_label()))
            .collect();
        draw_ladder_line(&mut chart, &pts, color, layout.to_string())?;
    }
    if !runs.is_empty() {
        draw_legend(&mut chart, 14)?;
    }

    // Right: rate → CPU % per pool.
    let top = runs
        .iter()
        .flat_map(|r| [r.redis_cpu_pct.mailbox, r.redis_cpu_pct.core])
        .flatten()
        .fold(100.0, f64::max)
        * 1.05;
    let mut chart = ChartBuilder::on(&right)
        .caption("Redis CPU % (mean per instance)", ("sans-serif", 20))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..max_rate, 0.0..top)
        .map_err(e)?;
    chart
        .configure_mesh()
        .x_desc("rate (msg/s)")
        .y_desc("CPU %")
        .y_label_formatter(&|y| format!("{y:.0}"))
        .x_label_formatter(&|x| crate::load::group_thousands(*x, 0))
        .label_style(("sans-serif", 14))
        .axis_desc_style(("sans-serif", 16))
        .draw()
        .map_err(e)?;
    let rho = TARGET_RHO * 100.0;
    chart
        .draw_series(DashedLineSeries::new(
            vec![(0.0, rho), (max_rate, rho)],
            6,
            4,
            RGBColor(120, 120, 120).stroke_width(1),
        ))
        .map_err(e)?
        .label("ρ = 0.65")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], RGBColor(120, 120, 120)));
    let mut k = 0;
    for layout in &layouts {
        for (pool, get) in [
            (
                "mailbox",
                (|r: &RunReport| r.redis_cpu_pct.mailbox) as fn(&RunReport) -> Option<f64>,
            ),
            ("core", |r: &RunReport| r.redis_cpu_pct.core),
        ] {
            let color = COLORS[k % COLORS.len()];
            k += 1;
            // a step whose CPU was not read has no point
            let pts: Vec<(f64, f64, String)> = runs
                .iter()
                .filter(|r| r.layout == *layout)
                .filter_map(|r| Some((r.rate, get(r)?, r.instances_label())))
                .collect();
            draw_ladder_line(&mut chart, &pts, color, format!("{pool} ({layout})"))?;
        }
    }
    draw_legend(&mut chart, 14)?;
    root.present().map_err(e)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nines_axis() {
        assert!((nines(90.0) - 1.0).abs() < 1e-9);
        assert!((nines(99.9) - 3.0).abs() < 1e-9);
        assert_eq!(nines(100.0), MAX_X);
        assert_eq!(nines_label(1.0), "90%");
        assert_eq!(nines_label(2.0), "99%");
        assert_eq!(nines_label(3.0), "99.9%");
        assert_eq!(nines_label(nines(50.0)), "50%");
        assert_eq!(nines_label(MAX_X), "max");
    }

    #[test]
    fn font_loads() {
        register_fonts().unwrap();
    }
}
