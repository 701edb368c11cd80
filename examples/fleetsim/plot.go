package main

import (
	"fmt"
	"image/color"
	"path/filepath"
	"strconv"
	"time"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/plotutil"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
)

func init() { writePlots = renderPlots }

// renderPlots writes occ-calls.png, occ-time.png and outage.png to dir.
func renderPlots(dir string, occ []OCCRow, oc OutageConfig, outage []OutageResult) ([]string, error) {
	var files []string
	calls := func(r OCCRow, s int) float64 { return r.Calls[s] }
	secs := func(r OCCRow, s int) float64 { return r.Time[s].Seconds() }
	for _, c := range []struct {
		file, title, ylabel string
		y                   func(OCCRow, int) float64
	}{
		{"occ-calls.png", "Work: write calls per run", "write calls", calls},
		{"occ-time.png", "Time until the last client succeeds (log scale)", "seconds", secs},
	} {
		p := plot.New()
		p.Title.Text = c.title
		p.X.Label.Text = "clients contending for one row"
		p.Y.Label.Text = c.ylabel
		p.X.Tick.Marker = clientTicks(occ)
		p.Y.Tick.Marker = plainTicks{}
		p.Legend.Top, p.Legend.Left = true, true
		if c.file == "occ-time.png" {
			// Exponential backoff without jitter is 10x slower than the
			// rest: a log scale keeps the others apart.
			p.Y.Scale = plot.LogScale{}
			p.Y.Tick.Marker = plot.LogTicks{Prec: -1}
			p.Legend.Left = false
			p.Legend.YOffs = -vg.Points(28)
		}
		p.Add(plotter.NewGrid())
		for s, st := range Strategies {
			pts := make(plotter.XYs, len(occ))
			for i, r := range occ {
				pts[i] = plotter.XY{X: float64(r.Clients), Y: c.y(r, s)}
			}
			if err := addLine(p, st.Name, pts, s, false); err != nil {
				return nil, err
			}
		}
		path := filepath.Join(dir, c.file)
		if err := p.Save(7*vg.Inch, 4.5*vg.Inch, path); err != nil {
			return nil, fmt.Errorf("saving %s: %w", path, err)
		}
		files = append(files, path)
	}

	p := plot.New()
	p.Title.Text = fmt.Sprintf("Outage %v-%v: requests reaching the server per second (%d clients)",
		oc.OutageStart, oc.OutageEnd, oc.Clients)
	p.X.Label.Text = "time (s)"
	p.Y.Label.Text = "requests per second"
	p.Legend.Top = true
	p.Y.Min = 0
	p.X.Tick.Marker = plainTicks{}
	p.Y.Tick.Marker = plainTicks{}
	p.Add(plotter.NewGrid())
	band, err := outageBand(oc, outage)
	if err != nil {
		return nil, err
	}
	p.Add(band)
	// Arrivals stop at oc.Duration: the few retries after it are left out.
	secondsShown := int(oc.Duration / time.Second)
	if err := addLine(p, "logical requests", series(outage[0].Logical, secondsShown), len(Strategies), true); err != nil {
		return nil, err
	}
	for i, r := range outage {
		if err := addLine(p, r.Policy, series(r.PerSecond, secondsShown), i, false); err != nil {
			return nil, err
		}
	}
	path := filepath.Join(dir, "outage.png")
	if err := p.Save(8*vg.Inch, 4.5*vg.Inch, path); err != nil {
		return nil, fmt.Errorf("saving %s: %w", path, err)
	}
	return append(files, path), nil
}

func addLine(p *plot.Plot, name string, pts plotter.XYs, i int, dashed bool) error {
	l, err := plotter.NewLine(pts)
	if err != nil {
		return fmt.Errorf("plotting %s: %w", name, err)
	}
	l.Color = plotutil.Color(i)
	l.Width = vg.Points(1.5)
	if dashed {
		l.Color = color.Gray{Y: 96}
		l.Dashes = []vg.Length{vg.Points(4), vg.Points(3)}
	}
	p.Add(l)
	p.Legend.Add(name, l)
	return nil
}

// series turns the first n per-second counts into points at the middle of
// each second.
func series(counts []int, n int) plotter.XYs {
	n = min(n, len(counts))
	pts := make(plotter.XYs, n)
	for s := range n {
		pts[s] = plotter.XY{X: float64(s) + 0.5, Y: float64(counts[s])}
	}
	return pts
}

// clientTicks marks the first contention level, every multiple of 50 and
// the last one.
func clientTicks(occ []OCCRow) plot.ConstantTicks {
	var ticks plot.ConstantTicks
	for i, r := range occ {
		if i == 0 || i == len(occ)-1 || r.Clients%50 == 0 {
			ticks = append(ticks, plot.Tick{Value: float64(r.Clients), Label: strconv.Itoa(r.Clients)})
		}
	}
	return ticks
}

// plainTicks are gonum's default ticks labelled without trailing zeros
// ("100", not "100.00").
type plainTicks struct{}

func (plainTicks) Ticks(lo, hi float64) []plot.Tick {
	ticks := plot.DefaultTicks{}.Ticks(lo, hi)
	for i := range ticks {
		if ticks[i].Label != "" {
			ticks[i].Label = strconv.FormatFloat(ticks[i].Value, 'f', -1, 64)
		}
	}
	return ticks
}

// outageBand shades the seconds in which the server fails.
func outageBand(oc OutageConfig, outage []OutageResult) (*plotter.Polygon, error) {
	top := 0
	for _, r := range outage {
		for _, n := range r.PerSecond {
			top = max(top, n)
		}
	}
	x0, x1 := oc.OutageStart.Seconds(), oc.OutageEnd.Seconds()
	y := float64(top) * 1.05
	band, err := plotter.NewPolygon(plotter.XYs{{X: x0, Y: 0}, {X: x1, Y: 0}, {X: x1, Y: y}, {X: x0, Y: y}})
	if err != nil {
		return nil, err
	}
	band.Color = color.RGBA{R: 255, G: 220, B: 220, A: 255}
	band.LineStyle = draw.LineStyle{Width: 0}
	return band, nil
}
