package main

import (
	"fmt"
	"image/color"
	"math"
	"os"
	"path/filepath"
	"strconv"
	"time"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgimg"
)

func init() { writePlots = renderPlots }

// The Okabe-Ito palette (Okabe and Ito, "Color Universal Design", 2008):
// colours that readers with red-green colour blindness tell apart too.
// Every line also has its own dash pattern (and, on the contention plots,
// its own marker), so that no line depends on its colour alone.
var (
	okabeOrange     = color.RGBA{R: 0xE6, G: 0x9F, B: 0x00, A: 0xFF}
	okabeSkyBlue    = color.RGBA{R: 0x56, G: 0xB4, B: 0xE9, A: 0xFF}
	okabeGreen      = color.RGBA{R: 0x00, G: 0x9E, B: 0x73, A: 0xFF}
	okabeBlue       = color.RGBA{R: 0x00, G: 0x72, B: 0xB2, A: 0xFF}
	okabeVermillion = color.RGBA{R: 0xD5, G: 0x5E, B: 0x00, A: 0xFF}
	okabePurple     = color.RGBA{R: 0xCC, G: 0x79, B: 0xA7, A: 0xFF}
	black           = color.Gray{Y: 0}
)

// style is how one series is drawn: a colour, a dash pattern (nil: solid)
// and a marker at every point (nil: none).
type style struct {
	color  color.Color
	dashes []vg.Length
	glyph  draw.GlyphDrawer
	radius float64 // of the glyph, in points (0: 3)
}

func dash(on, off float64) []vg.Length { return []vg.Length{vg.Points(on), vg.Points(off)} }

// strategyStyles follow Strategies. Equal and full jitter draw almost the
// same curve: one is a solid dark-blue line with small filled circles, the
// other a dashed light-blue line with large hollow triangles around them,
// drawn on top of it.
var strategyStyles = []style{
	// No backoff
	{color: okabeVermillion, glyph: draw.BoxGlyph{}},
	// Exponential (no jitter)
	{color: okabeOrange, dashes: dash(8, 3), glyph: draw.CrossGlyph{}, radius: 3.5},
	// Equal jitter
	{color: okabeSkyBlue, dashes: dash(5, 3), glyph: draw.TriangleGlyph{}, radius: 5},
	// Full jitter
	{color: okabeBlue, glyph: draw.CircleGlyph{}, radius: 2.5},
	// Decorrelated
	{color: okabePurple, dashes: []vg.Length{vg.Points(8), vg.Points(2), vg.Points(2), vg.Points(2)},
		glyph: draw.RingGlyph{}, radius: 3.5},
}

// renderPlots writes occ-calls.png, occ-time.png and outage.png to dir.
func renderPlots(dir string, occ []OCCRow, oc OutageConfig, outage []OutageResult) ([]string, error) {
	var files []string
	calls := func(r OCCRow, s int) float64 { return r.Calls[s] }
	secs := func(r OCCRow, s int) float64 { return r.Time[s].Seconds() }
	for _, c := range []struct {
		file, title, ylabel string
		y                   func(OCCRow, int) float64
		log                 bool
	}{
		{"occ-calls.png", "Work: write calls per run", "write calls", calls, false},
		// Exponential backoff without jitter is 10x slower than the rest:
		// a log scale keeps the others apart.
		{"occ-time.png", "Time until the last client succeeds (log scale)", "seconds", secs, true},
	} {
		p := plot.New()
		p.Title.Text = c.title
		p.X.Label.Text = "clients contending for one row"
		p.Y.Label.Text = c.ylabel
		p.X.Tick.Marker = clientTicks(occ)
		p.Y.Tick.Marker = niceTicks{}
		if c.log {
			p.Y.Scale = plot.LogScale{}
			p.Y.Tick.Marker = logTicks{}
		} else {
			p.Y.Min = 0
		}
		p.Add(plotter.NewGrid())
		legend := newLegend()
		var dashed []plot.Plotter
		for s, st := range Strategies {
			pts := make(plotter.XYs, len(occ))
			for i, r := range occ {
				pts[i] = plotter.XY{X: float64(r.Clients), Y: c.y(r, s)}
			}
			line, marks, err := newSeries(pts, strategyStyles[s])
			if err != nil {
				return nil, fmt.Errorf("plotting %s: %w", st.Name, err)
			}
			// Solid lines first, dashed ones over them: a dashed line
			// lets the one under it show through its gaps.
			if line.Dashes == nil {
				p.Add(line, marks)
			} else {
				dashed = append(dashed, line, marks)
			}
			legend.Add(st.Name, line, marks)
		}
		p.Add(dashed...)
		path := filepath.Join(dir, c.file)
		if err := save(p, legend, 8*vg.Inch, 4.5*vg.Inch, path); err != nil {
			return nil, err
		}
		files = append(files, path)
	}

	p := plot.New()
	p.Title.Text = fmt.Sprintf("Outage %v-%v: requests reaching the server per second (%d clients)",
		oc.OutageStart, oc.OutageEnd, oc.Clients)
	p.X.Label.Text = "time (s)"
	p.Y.Label.Text = "requests per second"
	p.X.Min, p.Y.Min = 0, 0
	p.X.Tick.Marker = niceTicks{}
	p.Y.Tick.Marker = niceTicks{}
	band, err := outageBand(oc, outage)
	if err != nil {
		return nil, err
	}
	p.Add(band, plotter.NewGrid())
	legend := newLegend()
	legend.Add("server answers 503", band)
	// Arrivals stop at oc.Duration: the few retries after it are left out.
	secondsShown := int(oc.Duration / time.Second)
	policyStyles := []style{
		{color: okabeVermillion},
		{color: okabeGreen, dashes: dash(7, 3)},
		{color: okabeBlue, dashes: []vg.Length{vg.Points(7), vg.Points(2), vg.Points(2), vg.Points(2)}},
	}
	for i, r := range outage {
		line, _, err := newSeries(series(r.PerSecond, secondsShown), policyStyles[i%len(policyStyles)])
		if err != nil {
			return nil, fmt.Errorf("plotting %s: %w", r.Policy, err)
		}
		p.Add(line)
		legend.Add(r.Policy, line)
	}
	// The logical requests last, on top: outside the outage every policy
	// sends about that many, and their lines would hide it.
	logical, _, err := newSeries(series(outage[0].Logical, secondsShown), style{color: black, dashes: dash(1.5, 2.5)})
	if err != nil {
		return nil, fmt.Errorf("plotting logical requests: %w", err)
	}
	logical.Width = vg.Points(2)
	p.Add(logical)
	legend.Add("logical requests (first attempts)", logical)
	path := filepath.Join(dir, "outage.png")
	if err := save(p, legend, 9*vg.Inch, 4.5*vg.Inch, path); err != nil {
		return nil, err
	}
	return append(files, path), nil
}

// newSeries returns the line through pts and, when the style has a glyph,
// a marker at every point (nil otherwise).
func newSeries(pts plotter.XYs, st style) (*plotter.Line, *plotter.Scatter, error) {
	line, err := plotter.NewLine(pts)
	if err != nil {
		return nil, nil, err
	}
	line.Color = st.color
	line.Width = vg.Points(1.5)
	line.Dashes = st.dashes
	if st.glyph == nil {
		return line, nil, nil
	}
	marks, err := plotter.NewScatter(pts)
	if err != nil {
		return nil, nil, err
	}
	r := st.radius
	if r == 0 {
		r = 3
	}
	marks.GlyphStyle = draw.GlyphStyle{Color: st.color, Radius: vg.Points(r), Shape: st.glyph}
	return line, marks, nil
}

// newLegend returns a legend with thumbnails wide enough to show each
// line's dash pattern.
func newLegend() plot.Legend {
	l := plot.NewLegend()
	l.Top, l.Left = true, true
	l.ThumbnailWidth = vg.Points(36)
	l.Padding = vg.Points(2)
	return l
}

// save draws p with its legend to the right of the plot, outside the data
// area, and writes a PNG of w x h.
func save(p *plot.Plot, legend plot.Legend, w, h vg.Length, path string) error {
	img := vgimg.New(w, h)
	dc := draw.New(img)
	const gap = 8
	lw := legend.Rectangle(dc).Size().X + vg.Points(gap)
	p.Draw(draw.Crop(dc, 0, -lw, 0, 0))
	// The legend starts level with the top of the data area.
	area := draw.Crop(dc, w-lw+vg.Points(gap/2), 0, 0, 0)
	legend.YOffs = -(p.Title.TextStyle.Height(p.Title.Text) + p.Title.Padding + vg.Points(gap))
	legend.Draw(area)
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if _, err := (vgimg.PngCanvas{Canvas: img}).WriteTo(f); err != nil {
		_ = f.Close()
		return fmt.Errorf("saving %s: %w", path, err)
	}
	return f.Close()
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

// niceTicks label 6 to 12 round values (steps of 1, 2, 2.5 or 5 times a
// power of ten) with an unlabelled minor tick between each two, written
// without trailing zeros ("1000", not "1000.00").
type niceTicks struct{}

func (niceTicks) Ticks(lo, hi float64) []plot.Tick {
	if !(hi > lo) {
		return []plot.Tick{{Value: lo, Label: strconv.FormatFloat(lo, 'f', -1, 64)}}
	}
	raw := (hi - lo) / 9
	pow := math.Pow(10, math.Floor(math.Log10(raw)))
	step := 10 * pow
	for _, m := range []float64{1, 2, 2.5, 5} {
		if m*pow >= raw {
			step = m * pow
			break
		}
	}
	var ticks []plot.Tick
	for i := math.Ceil(lo / step * 2); i*step/2 <= hi*(1+1e-9); i++ {
		v := i * step / 2
		t := plot.Tick{Value: v}
		if math.Mod(i, 2) == 0 {
			t.Label = strconv.FormatFloat(v, 'f', -1, 64)
		}
		ticks = append(ticks, t)
	}
	return ticks
}

// logTicks label 1, 2 and 5 times each power of ten in range, with
// unlabelled ticks at the other integer multiples.
type logTicks struct{}

func (logTicks) Ticks(lo, hi float64) []plot.Tick {
	var ticks []plot.Tick
	for e := math.Floor(math.Log10(lo)); math.Pow(10, e) <= hi; e++ {
		pow := math.Pow(10, e)
		for m := 1.0; m <= 9; m++ {
			v := m * pow
			if v < lo*(1-1e-9) || v > hi*(1+1e-9) {
				continue
			}
			t := plot.Tick{Value: v}
			if m == 1 || m == 2 || m == 5 {
				t.Label = strconv.FormatFloat(v, 'g', -1, 64)
			}
			ticks = append(ticks, t)
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
	band.Color = color.Gray{Y: 228}
	band.LineStyle = draw.LineStyle{Width: 0}
	return band, nil
}

func init() { writeChainPlot = renderChainPlot }

// renderChainPlot writes chain.png: one panel per variant, the bottom's
// requests per user request for the user requests arriving in each second,
// with the two outage phases shaded.
func renderChainPlot(dir string, c ChainConfig, rs []ChainResult) (string, error) {
	const cols = 2
	rows := (len(rs) + cols - 1) / cols
	plots := make([][]*plot.Plot, rows)
	styles := []style{
		{color: okabeVermillion},
		{color: okabeOrange, dashes: dash(7, 3)},
		{color: okabeGreen},
		{color: okabeBlue, dashes: dash(7, 3)},
	}
	secondsShown := int(c.Duration / time.Second)
	for i, r := range rs {
		p := plot.New()
		m := c.Summary(r)
		p.Title.Text = fmt.Sprintf("%s: peak %.2f, steady %.2f", r.Variant, m.Peak, m.FullSteady)
		p.X.Label.Text = "arrival of the user request (s)"
		p.Y.Label.Text = "bottom requests per user request"
		p.X.Min, p.X.Max, p.Y.Min = 0, float64(secondsShown), 0
		p.Y.Max = 3.5
		for _, a := range r.Amplification() {
			p.Y.Max = max(p.Y.Max, a*1.08)
		}
		p.X.Tick.Marker = niceTicks{}
		p.Y.Tick.Marker = niceTicks{}
		full, err := band(c.FullStart, c.HalfStart, p.Y.Max, color.Gray{Y: 205})
		if err != nil {
			return "", err
		}
		half, err := band(c.HalfStart, c.HalfEnd, p.Y.Max, color.Gray{Y: 232})
		if err != nil {
			return "", err
		}
		p.Add(full, half, plotter.NewGrid())
		pts := make(plotter.XYs, 0, secondsShown)
		for s, a := range r.Amplification()[:min(secondsShown, len(r.Users))] {
			pts = append(pts, plotter.XY{X: float64(s) + 0.5, Y: a})
		}
		line, _, err := newSeries(pts, styles[i%len(styles)])
		if err != nil {
			return "", fmt.Errorf("plotting %s: %w", r.Variant, err)
		}
		line.Width = vg.Points(2)
		p.Add(line)
		if i == 0 {
			p.Legend = newLegend()
			p.Legend.Left = false
			p.Legend.YOffs = -vg.Points(8)
			p.Legend.Add("bottom fails every request", full)
			p.Legend.Add("bottom fails half of them", half)
		}
		plots[i/cols] = append(plots[i/cols], p)
	}
	for len(plots[rows-1]) < cols {
		plots[rows-1] = append(plots[rows-1], nil)
	}
	w, h := 12*vg.Inch, 4*vg.Inch*vg.Length(rows)
	img := vgimg.New(w, h)
	dc := draw.New(img)
	tiles := draw.Tiles{Rows: rows, Cols: cols, PadX: vg.Points(18), PadY: vg.Points(18),
		PadTop: vg.Points(6), PadBottom: vg.Points(6), PadLeft: vg.Points(6), PadRight: vg.Points(12)}
	canvases := plot.Align(plots, tiles, dc)
	for i := range plots {
		for j, p := range plots[i] {
			if p != nil {
				p.Draw(canvases[i][j])
			}
		}
	}
	path := filepath.Join(dir, "chain.png")
	f, err := os.Create(path)
	if err != nil {
		return "", err
	}
	if _, err := (vgimg.PngCanvas{Canvas: img}).WriteTo(f); err != nil {
		_ = f.Close()
		return "", fmt.Errorf("saving %s: %w", path, err)
	}
	return path, f.Close()
}

// band shades [from, to) up to top.
func band(from, to time.Duration, top float64, c color.Color) (*plotter.Polygon, error) {
	x0, x1 := from.Seconds(), to.Seconds()
	b, err := plotter.NewPolygon(plotter.XYs{{X: x0, Y: 0}, {X: x1, Y: 0}, {X: x1, Y: top}, {X: x0, Y: top}})
	if err != nil {
		return nil, err
	}
	b.Color = c
	b.LineStyle = draw.LineStyle{Width: 0}
	return b, nil
}
