//! `shoal plot REPORT.json... -o FILE.svg|png`: the curves of `train`, `run` and `netsim`
//! reports (loss, throughput, and per stage: device memory or busy time), drawn with
//! `plotters`. Several reports of one kind are drawn over each other, one colour each, for
//! comparison. `shoal netsim --plot` draws the same way.

use anyhow::{Context, bail};
use plotters::coord::Shift;
use plotters::prelude::*;
use serde_json::Value;
use std::path::Path;

/// One chart: a title, axis labels and one named line per report.
struct Panel {
    title: &'static str,
    x_label: &'static str,
    y_label: &'static str,
    /// Start the y axis at 0 (throughput, memory) rather than at the lowest value (loss).
    from_zero: bool,
    /// Mark each point (few points, e.g. one per stage).
    points: bool,
    series: Vec<(String, Vec<(f64, f64)>)>,
}

/// The kinds of report and what is drawn of each.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Kind {
    Train,
    Run,
    Netsim,
}

fn kind_of(report: &Value) -> Option<Kind> {
    if report.get("sim_seconds").is_some() && report.get("tokens_curve").is_some() {
        Some(Kind::Netsim)
    } else if report.get("peer_id").is_some() && report.get("loss_curve").is_some() {
        Some(Kind::Run)
    } else if report.get("held_out_loss").is_some() && report.get("loss_curve").is_some() {
        Some(Kind::Train)
    } else {
        None
    }
}

/// `[[x, y], ...]` or `[[x, _, y], ...]` (columns `x` and `y`) as points.
fn pairs(v: &Value, x: usize, y: usize) -> Vec<(f64, f64)> {
    v.as_array()
        .map(|rows| {
            rows.iter()
                .filter_map(|r| Some((r.get(x)?.as_f64()?, r.get(y)?.as_f64()?)))
                .filter(|(a, b)| a.is_finite() && b.is_finite())
                .collect()
        })
        .unwrap_or_default()
}

/// Tokens per second over about 40 equal windows of a `(seconds, tokens so far)` curve.
pub fn throughput(curve: &[(f64, f64)]) -> Vec<(f64, f64)> {
    let Some(&(t_max, _)) = curve.last() else {
        return Vec::new();
    };
    if t_max <= 0.0 {
        return Vec::new();
    }
    let windows = 40.min(curve.len().max(2) - 1).max(1);
    let dt = t_max / windows as f64;
    // Tokens by time t, linear between points.
    let at = |t: f64| -> f64 {
        match curve.iter().position(|p| p.0 >= t) {
            None => curve[curve.len() - 1].1,
            Some(0) => curve[0].1,
            Some(i) => {
                let (a, b) = (curve[i - 1], curve[i]);
                let f = if b.0 > a.0 {
                    (t - a.0) / (b.0 - a.0)
                } else {
                    1.0
                };
                a.1 + f * (b.1 - a.1)
            }
        }
    };
    (0..windows)
        .map(|i| {
            let (t0, t1) = (i as f64 * dt, (i + 1) as f64 * dt);
            ((t0 + t1) / 2.0, (at(t1) - at(t0)) / dt)
        })
        .collect()
}

/// The panels for reports of one kind, each report a series named `names[i]`.
fn panels(kind: Kind, reports: &[(String, Value)]) -> Vec<Panel> {
    let panel = |title, x_label, y_label, from_zero, points| Panel {
        title,
        x_label,
        y_label,
        from_zero,
        points,
        series: Vec::new(),
    };
    let mut out = match kind {
        Kind::Netsim => vec![
            panel("loss", "simulated seconds", "loss", false, false),
            panel("throughput", "simulated seconds", "tokens/s", true, false),
            panel(
                "busy time per stage",
                "stage",
                "device-seconds busy per second",
                true,
                true,
            ),
        ],
        Kind::Run => vec![
            panel("loss", "step", "loss", false, false),
            panel(
                "throughput of the peer's stage",
                "seconds",
                "tokens/s",
                true,
                false,
            ),
        ],
        Kind::Train => vec![
            panel("loss", "step", "loss", false, false),
            panel("throughput", "seconds", "tokens/s", true, false),
            panel("device memory per stage", "stage", "peak MB", true, true),
        ],
    };
    for (name, r) in reports {
        let lines: Vec<Vec<(f64, f64)>> = match kind {
            Kind::Netsim => {
                let seconds = r["sim_seconds"].as_f64().unwrap_or(0.0).max(1e-9);
                let busy = r["stage_busy_seconds"]
                    .as_array()
                    .map(|v| {
                        v.iter()
                            .enumerate()
                            .filter_map(|(s, b)| Some((s as f64, b.as_f64()? / seconds)))
                            .collect()
                    })
                    .unwrap_or_default();
                vec![
                    pairs(&r["loss_curve"], 0, 2),
                    throughput(&pairs(&r["tokens_curve"], 0, 1)),
                    busy,
                ]
            }
            Kind::Run => vec![
                pairs(&r["loss_curve"], 0, 1),
                throughput(&pairs(&r["tokens_curve"], 0, 1)),
            ],
            Kind::Train => vec![
                pairs(&r["loss_curve"], 0, 1),
                throughput(&pairs(&r["tokens_curve"], 0, 1)),
                r["device_memory_peak_bytes"]
                    .as_array()
                    .map(|v| {
                        v.iter()
                            .enumerate()
                            .filter_map(|(s, b)| Some((s as f64, b.as_f64()? / 1e6)))
                            .collect()
                    })
                    .unwrap_or_default(),
            ],
        };
        for (p, line) in out.iter_mut().zip(lines) {
            p.series.push((name.clone(), line));
        }
        // netsim's points are `[sim_s, step, loss]`, drawn against simulated seconds.
        let loss_column = if kind == Kind::Netsim { 2 } else { 1 };
        let held_out = pairs(&r["val_curve"], 0, loss_column);
        if !held_out.is_empty() {
            out[0].series.push((format!("{name} (held-out)"), held_out));
        }
    }
    out.retain(|p| p.series.iter().any(|(_, l)| !l.is_empty()));
    out
}

/// Draws `panels` one above the other on `area`.
fn draw<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    title: &str,
    panels: &[Panel],
) -> anyhow::Result<()>
where
    DB::ErrorType: 'static,
{
    let err = |e: DrawingAreaErrorKind<DB::ErrorType>| anyhow::anyhow!("drawing: {e:?}");
    area.fill(&WHITE).map_err(err)?;
    let area = area.titled(title, ("sans-serif", 22)).map_err(err)?;
    let rows = area.split_evenly((panels.len().max(1), 1));
    for (panel, area) in panels.iter().zip(rows.iter()) {
        let all = panel.series.iter().flat_map(|(_, l)| l.iter());
        let (mut x0, mut x1, mut y0, mut y1) = all.fold(
            (
                f64::INFINITY,
                f64::NEG_INFINITY,
                f64::INFINITY,
                f64::NEG_INFINITY,
            ),
            |(a, b, c, d), &(x, y)| (a.min(x), b.max(x), c.min(y), d.max(y)),
        );
        if panel.from_zero {
            y0 = y0.min(0.0);
        }
        if x1 <= x0 {
            (x0, x1) = (x0 - 0.5, x0 + 0.5);
        }
        if y1 <= y0 {
            (y0, y1) = (y0 - 0.5, y1 + 0.5);
        }
        let pad = (y1 - y0) * 0.05;
        let mut chart = ChartBuilder::on(area)
            .caption(panel.title, ("sans-serif", 16))
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(64)
            .build_cartesian_2d(
                x0..x1,
                (if panel.from_zero { y0 } else { y0 - pad })..y1 + pad,
            )
            .map_err(err)?;
        let stage_axis = panel.points && x1 - x0 < 64.0;
        chart
            .configure_mesh()
            .x_desc(panel.x_label)
            .y_desc(panel.y_label)
            .x_labels(if stage_axis {
                (x1 - x0) as usize + 1
            } else {
                10
            })
            .x_label_formatter(&|v| {
                if stage_axis {
                    format!("{}", v.round())
                } else {
                    tick(*v)
                }
            })
            .y_label_formatter(&|v| tick(*v))
            .label_style(("sans-serif", 12))
            .max_light_lines(1)
            .light_line_style(RGBColor(240, 240, 240))
            .draw()
            .map_err(err)?;
        for (i, (name, line)) in panel.series.iter().enumerate() {
            let color = Palette99::pick(i).to_rgba();
            let style = ShapeStyle::from(color).stroke_width(2);
            let drawn = chart
                .draw_series(LineSeries::new(line.iter().copied(), style))
                .map_err(err)?;
            drawn
                .label(name.as_str())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], style));
            if panel.points {
                chart
                    .draw_series(line.iter().map(|&p| Circle::new(p, 4, color.filled())))
                    .map_err(err)?;
            }
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK.mix(0.3))
            .label_font(("sans-serif", 12))
            .draw()
            .map_err(err)?;
    }
    area.present().map_err(err)?;
    Ok(())
}

/// A tick label: no more digits than the value needs.
fn tick(v: f64) -> String {
    let text = if v.abs() >= 100.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.3}")
    };
    if text.contains('.') {
        text.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        text
    }
}

/// The font text is measured and (in a PNG) drawn with, embedded (DejaVu Sans cut to ASCII
/// and a few signs; its licence is beside it), so plotting needs no system fonts.
fn register_font() -> anyhow::Result<()> {
    static FONT: &[u8] = include_bytes!("../assets/DejaVuSans-subset.ttf");
    static ONCE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let ok = *ONCE.get_or_init(|| {
        plotters::style::register_font("sans-serif", FontStyle::Normal, FONT).is_ok()
    });
    if !ok {
        bail!("the embedded font cannot be read");
    }
    Ok(())
}

/// Writes a figure of `reports` (name, JSON) to `out`: SVG or PNG by its extension.
pub fn write(title: &str, reports: &[(String, Value)], out: &Path) -> anyhow::Result<()> {
    let Some(kind) = reports.first().and_then(|(_, r)| kind_of(r)) else {
        bail!("not a report of shoal train, run or netsim");
    };
    if let Some((name, _)) = reports.iter().find(|(_, r)| kind_of(r) != Some(kind)) {
        bail!("{name} is not a {kind:?} report like the first: plot reports of one kind together");
    }
    let panels = panels(kind, reports);
    if panels.is_empty() {
        bail!("nothing to plot: the report has no curve yet");
    }
    // Both backends lay text out with it.
    register_font()?;
    let size = (1000, 300 * panels.len() as u32 + 40);
    let ext = out
        .extension()
        .and_then(|e| e.to_str())
        .map(str::to_ascii_lowercase);
    match ext.as_deref() {
        Some("svg") => {
            let mut svg = String::new();
            draw(
                &SVGBackend::with_string(&mut svg, size).into_drawing_area(),
                title,
                &panels,
            )?;
            shoal_compute::write_atomic(out, svg.as_bytes())
                .with_context(|| format!("cannot write {}", out.display()))
        }
        Some("png") => {
            let mut pixels = vec![0u8; size.0 as usize * size.1 as usize * 3];
            let backend = BitMapBackend::with_buffer(&mut pixels, size);
            draw(&backend.into_drawing_area(), title, &panels)?;
            let mut png = Vec::new();
            image_png(&mut png, &pixels, size)?;
            shoal_compute::write_atomic(out, &png)
                .with_context(|| format!("cannot write {}", out.display()))
        }
        _ => bail!(
            "{}: the plot's file name must end in .svg or .png",
            out.display()
        ),
    }
}

/// Encodes RGB pixels as a PNG.
fn image_png(out: &mut Vec<u8>, pixels: &[u8], (w, h): (u32, u32)) -> anyhow::Result<()> {
    use image::ImageEncoder;
    image::codecs::png::PngEncoder::new(out)
        .write_image(pixels, w, h, image::ColorType::Rgb8)
        .context("encoding the PNG")
}

/// `shoal plot`.
pub fn run(args: crate::cli::PlotArgs) -> anyhow::Result<()> {
    let mut reports = Vec::new();
    for path in &args.reports {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read {}", path.display()))?;
        let value: Value = serde_json::from_str(&text)
            .with_context(|| format!("{} is not JSON", path.display()))?;
        let name = path
            .file_stem()
            .map_or("report".into(), |s| s.to_string_lossy().into_owned());
        reports.push((name, value));
    }
    let title = args.title.clone().unwrap_or_else(|| {
        reports
            .iter()
            .map(|(n, _)| n.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    });
    write(&title, &reports, &args.output)
        .with_context(|| format!("{}", args.reports[0].display()))?;
    println!("plot: {}", args.output.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn throughput_windows_follow_the_tokens_curve() {
        // 100 tokens/s for 10 s.
        let curve: Vec<(f64, f64)> = (0..=10).map(|i| (i as f64, 100.0 * i as f64)).collect();
        let rate = throughput(&curve);
        assert_eq!(rate.len(), 10);
        for (_, r) in rate {
            assert!((r - 100.0).abs() < 1e-6, "{r}");
        }
        assert!(throughput(&[]).is_empty());
    }

    fn run_report(loss: f64) -> Value {
        json!({
            "peer_id": "p",
            "loss_curve": [[1, loss], [2, loss - 1.0], [3, loss - 1.5]],
            "tokens_curve": [[0.0, 0], [1.0, 100], [2.0, 250]],
        })
    }

    #[test]
    fn reports_become_svg_and_png_with_a_legend() {
        let dir = std::env::temp_dir().join(format!("shoal-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let reports = vec![
            ("a".to_string(), run_report(5.0)),
            ("b".to_string(), run_report(4.0)),
        ];
        let svg = dir.join("p.svg");
        write("two peers", &reports, &svg).unwrap();
        let text = std::fs::read_to_string(&svg).unwrap();
        assert!(
            text.starts_with("<svg") && text.contains("polyline"),
            "{text}"
        );
        // Title, axis descriptions and the legend's names are text elements.
        for label in ["two peers", "loss", "tokens/s", "step", "a", "b"] {
            assert!(
                text.contains(&format!(">\n{label}\n</text>")),
                "{label} missing"
            );
        }
        let png = dir.join("p.png");
        write("two peers", &reports, &png).unwrap();
        let bytes = std::fs::read(&png).unwrap();
        assert_eq!(&bytes[1..4], b"PNG");
        // Reports of different kinds, or none that plotters can draw, are refused clearly.
        let mixed = vec![
            reports[0].clone(),
            ("t".into(), json!({"held_out_loss": 1.0, "loss_curve": []})),
        ];
        let e = write("x", &mixed, &svg).unwrap_err().to_string();
        assert!(e.contains("t is not a Run report"), "{e}");
        let e = write("x", &[("x".into(), json!({"a": 1}))], &svg)
            .unwrap_err()
            .to_string();
        assert!(e.contains("not a report"), "{e}");
        let e = write("x", &reports, &dir.join("p.gif"))
            .unwrap_err()
            .to_string();
        assert!(e.contains(".svg or .png"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
