package ingest

import (
	"os"
	"sync"
	"testing"
	"time"

	"github.com/tidepool-dev/tidepool/casstore"
)

func BenchmarkZZParts(b *testing.B) {
	tree := goSrc(b)
	files, _ := regularFiles(b, tree)
	s := newStore(b)
	Dir(b.Context(), s, tree, Options{})
	par := func(fn func(f string)) time.Duration {
		t0 := time.Now()
		ch := make(chan string)
		var wg sync.WaitGroup
		for range 4 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for f := range ch {
					fn(f)
				}
			}()
		}
		for _, f := range files {
			ch <- f
		}
		close(ch)
		wg.Wait()
		return time.Since(t0)
	}
	hashes := make(map[string]casstore.Hash)
	var mu sync.Mutex
	b.Logf("read+hash: %v", par(func(f string) {
		d, _ := os.ReadFile(f)
		h := casstore.Sum(d)
		mu.Lock()
		hashes[f] = h
		mu.Unlock()
	}))
	b.Logf("lstat objects: %v", par(func(f string) { os.Lstat(s.Path(hashes[f])) }))
	now := time.Now()
	b.Logf("chtimes objects: %v", par(func(f string) { os.Chtimes(s.Path(hashes[f]), now, now) }))
	b.Logf("lstat objects: %v", par(func(f string) { os.Lstat(s.Path(hashes[f])) }))
	b.Logf("read+hash: %v", par(func(f string) {
		d, _ := os.ReadFile(f)
		casstore.Sum(d)
	}))
}
