//! `--plot FILE.svg` (feature `plot`): the TTFT and TPOT distributions and the prefix cache's
//! token hit rate over time, one line per pass (caches on and off when `--verify` ran both).
//!
//! SVG through `plotters` without any font backend: text is written as SVG `<text>` elements
//! that the viewer renders, so neither a font file nor a GPU is needed to make the picture (CI
//! builds it). Distributions are empirical CDFs: the fraction of turns at or below each time.

use plotters::coord::Shift;
use plotters::prelude::*;

use crate::PassSeries;

/// Line colours of the passes, in order.
const COLOURS: [RGBColor; 2] = [RGBColor(31, 119, 180), RGBColor(214, 39, 40)];

fn text(err: impl std::fmt::Display) -> String {
    err.to_string()
}

/// The three panels for `passes`, as an SVG document.
pub fn render(title: &str, passes: &[&PassSeries]) -> Result<String, String> {
    let mut svg = String::new();
    draw(&mut svg, title, passes)?;
    Ok(svg)
}

fn draw(svg: &mut String, title: &str, passes: &[&PassSeries]) -> Result<(), String> {
    let root = SVGBackend::with_string(svg, (1000, 1100)).into_drawing_area();
    root.fill(&WHITE).map_err(text)?;
    let root = root.titled(title, ("sans-serif", 22)).map_err(text)?;
    let panels = root.split_evenly((3, 1));
    let ttft: Vec<(&str, Vec<f64>)> = passes
        .iter()
        .map(|pass| (pass.label.as_str(), pass.ttft_ms.clone()))
        .collect();
    let tpot: Vec<(&str, Vec<f64>)> = passes
        .iter()
        .map(|pass| (pass.label.as_str(), pass.tpot_ms.clone()))
        .collect();
    cdf(&panels[0], "Time to first token", &ttft)?;
    cdf(&panels[1], "Time per output token", &tpot)?;
    hit_rate(&panels[2], passes)?;
    root.present().map_err(text)?;
    Ok(())
}

/// One panel of empirical CDFs.
fn cdf(
    area: &DrawingArea<SVGBackend<'_>, Shift>,
    caption: &str,
    series: &[(&str, Vec<f64>)],
) -> Result<(), String> {
    let max = series
        .iter()
        .flat_map(|(_, values)| values.iter().copied())
        .fold(0.0_f64, f64::max);
    let max = if max > 0.0 { max * 1.05 } else { 1.0 };
    let mut chart = ChartBuilder::on(area)
        .caption(caption, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(55)
        .build_cartesian_2d(0.0..max, 0.0..1.0)
        .map_err(text)?;
    chart
        .configure_mesh()
        .x_desc("milliseconds")
        .y_desc("fraction of turns")
        .draw()
        .map_err(text)?;
    for (index, (label, values)) in series.iter().enumerate() {
        let colour = COLOURS[index % COLOURS.len()];
        let mut sorted = values.clone();
        sorted.sort_by(f64::total_cmp);
        let n = sorted.len().max(1) as f64;
        let points: Vec<(f64, f64)> = sorted
            .iter()
            .enumerate()
            .map(|(rank, value)| (*value, (rank + 1) as f64 / n))
            .collect();
        chart
            .draw_series(LineSeries::new(points, colour.stroke_width(2)))
            .map_err(text)?
            .label(format!("{label} ({} turns)", sorted.len()))
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], colour.stroke_width(2))
            });
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .draw()
        .map_err(text)?;
    Ok(())
}

/// The cumulative token hit rate of the prefix cache against the pass's elapsed time.
fn hit_rate(
    area: &DrawingArea<SVGBackend<'_>, Shift>,
    passes: &[&PassSeries],
) -> Result<(), String> {
    let end = passes
        .iter()
        .flat_map(|pass| pass.hit_rate.iter().map(|(seconds, _)| *seconds))
        .fold(0.0_f64, f64::max);
    let end = if end > 0.0 { end * 1.02 } else { 1.0 };
    let mut chart = ChartBuilder::on(area)
        .caption("Prefix-cache token hit rate so far", ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(55)
        .build_cartesian_2d(0.0..end, 0.0..100.0)
        .map_err(text)?;
    chart
        .configure_mesh()
        .x_desc("seconds into the pass")
        .y_desc("prompt tokens from cache (%)")
        .draw()
        .map_err(text)?;
    for (index, pass) in passes.iter().enumerate() {
        let colour = COLOURS[index % COLOURS.len()];
        chart
            .draw_series(LineSeries::new(
                pass.hit_rate.iter().copied(),
                colour.stroke_width(2),
            ))
            .map_err(text)?
            .label(pass.label.clone())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], colour.stroke_width(2))
            });
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .draw()
        .map_err(text)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_svg_has_three_panels_and_one_line_per_pass() {
        let pass = |label: &str, scale: f64| PassSeries {
            label: label.to_string(),
            ttft_ms: vec![10.0 * scale, 30.0 * scale, 20.0 * scale],
            tpot_ms: vec![2.0 * scale, 3.0 * scale],
            hit_rate: vec![(0.5, 0.0), (1.0, 25.0), (2.0, 40.0)],
        };
        let (on, off) = (pass("caches on", 1.0), pass("caches off", 2.0));
        let svg = render("replay of chat (3 turns)", &[&on, &off]).unwrap();
        assert!(svg.starts_with("<svg"), "{}", &svg[..80.min(svg.len())]);
        for caption in [
            "replay of chat (3 turns)",
            "Time to first token",
            "Time per output token",
            "Prefix-cache token hit rate so far",
            "caches on (3 turns)",
            "caches off (2 turns)",
        ] {
            assert!(svg.contains(caption), "missing {caption}");
        }
        // Each pass: one line in each of the three panels and one legend sample per panel.
        assert_eq!(svg.matches("stroke=\"#1F77B4\"").count(), 6);
        assert_eq!(svg.matches("stroke=\"#D62728\"").count(), 6);
    }
}
