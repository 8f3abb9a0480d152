// Drives llm-d's in-memory KV-block index (github.com/llm-d/llm-d-kv-cache pkg/kvcache/kvblock
// InMemoryIndex, unmodified; go.mod requires it at commit 7be76e1 by pseudo-version) and its
// LongestPrefixScorer (pkg/kvcache) from the common event file.
// Stored -> Index.Add(engineKeys=seq, requestKeys=seq, [pod]); Removed -> Index.Evict(seq, EngineKey,
// [pod]) per block (what pkg/kvevents' pool does); query -> Index.Lookup(seq keys, all pods) +
// LongestPrefixScorer.Score (per-pod consecutive-prefix length, the figure kvidx/Dynamo return).
// Hashing pass: ChunkedTokenDatabase.TokensToKVBlockKeys on the synthesized tokens.
package main

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"os"
	"runtime"
	"runtime/debug"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/llm-d/llm-d-kv-cache/pkg/kvcache/kvblock"
	"k8s.io/apimachinery/pkg/util/sets"
)

type rec struct {
	typ    byte
	w      uint32
	parent uint64
	hasPar bool
	seq    []kvblock.BlockHash
	ids    []uint64
}

func rss() uint64 {
	b, _ := os.ReadFile("/proc/self/statm")
	f := strings.Fields(string(b))
	v, _ := strconv.ParseUint(f[1], 10, 64)
	return v * 4096
}

func load(path string) (int, int, []rec) {
	data, err := os.ReadFile(path)
	if err != nil {
		panic(err)
	}
	if string(data[:8]) != "KVEVTS01" {
		panic("bad magic")
	}
	p := 8
	u32 := func() uint32 { v := binary.LittleEndian.Uint32(data[p:]); p += 4; return v }
	u64 := func() uint64 { v := binary.LittleEndian.Uint64(data[p:]); p += 8; return v }
	hv := func(n int) []kvblock.BlockHash {
		o := make([]kvblock.BlockHash, n)
		for i := range o {
			o[i] = kvblock.BlockHash(u64())
		}
		return o
	}
	nw := int(u32())
	bt := int(u32())
	n := int(u64())
	recs := make([]rec, 0, n)
	for i := 0; i < n; i++ {
		t := data[p]
		p++
		switch t {
		case 0:
			k := int(u32())
			seq := hv(k)
			p += 8 * k // Dynamo local hashes: unused here
			ids := make([]uint64, k)
			for j := range ids {
				ids[j] = u64()
			}
			recs = append(recs, rec{typ: 0, seq: seq, ids: ids})
		case 1:
			w := u32()
			hp := data[p]
			p++
			par := u64()
			k := int(u32())
			seq := hv(k)
			p += 8 * k
			recs = append(recs, rec{typ: 1, w: w, parent: par, hasPar: hp == 1, seq: seq})
		case 2:
			w := u32()
			k := int(u32())
			recs = append(recs, rec{typ: 2, w: w, seq: hv(k)})
		default:
			panic("bad record")
		}
	}
	return nw, bt, recs
}

func pct(v []float64, q float64) float64 {
	s := append([]float64(nil), v...)
	sort.Float64s(s)
	idx := int(float64(len(s)-1)*q/100.0 + 0.5)
	return s[idx]
}

func heap() uint64 {
	runtime.GC()
	debug.FreeOSMemory()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m.HeapAlloc
}

func main() {
	path := os.Args[1]
	podCache := 0
	if len(os.Args) > 2 {
		podCache, _ = strconv.Atoi(os.Args[2])
	}
	ctx := context.Background()
	t0 := time.Now()
	nw, bt, recs := load(path)
	loadS := time.Since(t0).Seconds()
	if podCache == 0 {
		podCache = nw // lossless: every worker can be listed under a key
	}
	pods := make([][]kvblock.PodEntry, nw)
	for w := range pods {
		pods[w] = []kvblock.PodEntry{{PodIdentifier: fmt.Sprintf("pod-%03d", w), DeviceTier: "gpu"}}
	}
	cfg := &kvblock.InMemoryIndexConfig{Size: 1e8, PodCacheSize: podCache}
	blockEvents := 0
	for _, r := range recs {
		if r.typ != 0 {
			blockEvents += len(r.seq)
		}
	}
	apply := func(idx *kvblock.InMemoryIndex, r *rec) error {
		if r.typ == 1 {
			return idx.Add(ctx, r.seq, r.seq, pods[r.w])
		}
		for _, h := range r.seq {
			if err := idx.Evict(ctx, h, kvblock.EngineKey, pods[r.w]); err != nil {
				return err
			}
		}
		return nil
	}
	errors := 0

	// ---- ingest pass ----
	heap0 := heap()
	rss0 := rss()
	idx, err := kvblock.NewInMemoryIndex(cfg)
	if err != nil {
		panic(err)
	}
	t := time.Now()
	for i := range recs {
		if recs[i].typ != 0 {
			if apply(idx, &recs[i]) != nil {
				errors++
			}
		}
	}
	ingestS := time.Since(t).Seconds()
	heap1 := heap()
	rss1 := rss()
	// live (key, pod) entries
	entries := 0
	for _, r := range recs { // count via lookup of every stored key would be slow; use Lookup on all distinct stored keys
		_ = r
		break
	}
	{
		seen := map[kvblock.BlockHash]struct{}{}
		for _, r := range recs {
			if r.typ == 1 {
				for _, h := range r.seq {
					seen[h] = struct{}{}
				}
			}
		}
		keys := make([]kvblock.BlockHash, 0, len(seen))
		for h := range seen {
			keys = append(keys, h)
		}
		for i := 0; i < len(keys); i += 4096 {
			j := min(i+4096, len(keys))
			m, _ := idx.Lookup(ctx, keys[i:j], sets.New[string]())
			for _, v := range m {
				entries += len(v)
			}
		}
	}
	idx = nil
	runtime.GC()

	// ---- mixed pass ----
	scorer := &longestPrefixScorer{MediumWeights: map[string]float64{"gpu": 1.0}}
	idx2, _ := kvblock.NewInMemoryIndex(cfg)
	empty := sets.New[string]()
	lat := make([]float64, 0, len(recs))
	var evNs int64
	var checksum float64
	hitQ, qBlocks := 0, 0
	tw := time.Now()
	for i := range recs {
		r := &recs[i]
		if r.typ == 0 {
			qBlocks += len(r.seq)
			t := time.Now()
			m, err := idx2.Lookup(ctx, r.seq, empty)
			if err != nil {
				panic(err)
			}
			sc, _ := scorer.Score(ctx, r.seq, m)
			lat = append(lat, float64(time.Since(t).Nanoseconds())/1e3)
			s := 0.0
			for _, v := range sc {
				s += v
			}
			checksum += s
			if s > 0 {
				hitQ++
			}
		} else {
			t := time.Now()
			if apply(idx2, r) != nil {
				errors++
			}
			evNs += time.Since(t).Nanoseconds()
		}
	}
	mixedWall := time.Since(tw).Seconds()
	sum := 0.0
	for _, v := range lat {
		sum += v
	}

	// ---- hashing pass ----
	tp, err := kvblock.NewChunkedTokenDatabase(&kvblock.TokenProcessorConfig{BlockSizeTokens: bt})
	if err != nil {
		panic(err)
	}
	hashEvery := 1
	if s := os.Getenv("HASH_EVERY"); s != "" {
		hashEvery, _ = strconv.Atoi(s)
	}
	hl := []float64{}
	hb := 0
	htot := 0.0
	qi := 0
	for i := range recs {
		if recs[i].typ != 0 {
			continue
		}
		qi++
		if (qi-1)%hashEvery != 0 {
			continue
		}
		toks := make([]uint32, 0, len(recs[i].ids)*bt)
		for _, id := range recs[i].ids {
			for j := 0; j < bt; j++ {
				toks = append(toks, uint32(id))
			}
		}
		t := time.Now()
		keys, err := tp.TokensToKVBlockKeys(kvblock.EmptyBlockHash, toks, "bench-model", nil)
		us := float64(time.Since(t).Nanoseconds()) / 1e3
		if err != nil {
			panic(err)
		}
		hl = append(hl, us)
		htot += us
		hb += len(keys)
	}
	out := map[string]any{
		"indexer": fmt.Sprintf("llm-d InMemoryIndex (podCacheSize %d)", podCache), "load_s": loadS,
		"block_events": blockEvents, "event_errors": errors, "ingest_s": ingestS,
		"ingest_blocks_per_s": float64(blockEvents) / ingestS,
		"mixed_event_s": float64(evNs) / 1e9, "mixed_ingest_blocks_per_s": float64(blockEvents) / (float64(evNs) / 1e9),
		"mixed_wall_s": mixedWall, "queries": len(lat), "query_blocks": qBlocks,
		"lookup_p50_us": pct(lat, 50), "lookup_p99_us": pct(lat, 99), "lookup_p999_us": pct(lat, 99.9),
		"lookup_mean_us": sum / float64(len(lat)), "lookups_per_s": float64(len(lat)) / (sum / 1e6),
		"checksum": checksum, "hit_queries": hitQ, "entries": entries,
		"index_heap_bytes": int64(heap1) - int64(heap0), "rss_base_bytes": rss0, "rss_after_ingest_bytes": rss1,
		"hash_queries": len(hl), "hash_blocks": hb, "hash_p50_us": pct(hl, 50), "hash_p99_us": pct(hl, 99),
		"hash_blocks_per_s": float64(hb) / (htot / 1e6), "go": runtime.Version(), "gomaxprocs": runtime.GOMAXPROCS(0),
	}
	b, _ := json.Marshal(out)
	fmt.Println(string(b))
}

// longestPrefixScorer: llm-d pkg/kvcache/kvblock_scorer.go LongestPrefixScorer.Score and
// fillMaxWeights, copied verbatim (commit 7be76e1) because importing pkg/kvcache pulls in the
// tokenization/gRPC/telemetry packages; only the receiver type name differs.
type longestPrefixScorer struct {
	MediumWeights map[string]float64
}

func fillMaxWeights(dst map[string]float64, entries []kvblock.PodEntry, mediumWeights map[string]float64) {
	for _, entry := range entries {
		weight := 1.0
		if mediumWeights != nil {
			if w, exists := mediumWeights[entry.DeviceTier]; exists {
				weight = w
			}
		}
		if cur, exists := dst[entry.PodIdentifier]; !exists || weight > cur {
			dst[entry.PodIdentifier] = weight
		}
	}
}

func (s *longestPrefixScorer) Score(
	_ context.Context,
	keys []kvblock.BlockHash,
	keyToPods map[kvblock.BlockHash][]kvblock.PodEntry,
) (map[string]float64, error) {
	if len(keys) == 0 {
		return make(map[string]float64), nil
	}

	podScores := make(map[string]float64)

	// Scratch map reused across iterations to avoid per-key allocation.
	curWeights := make(map[string]float64)

	// Build weight index for the first key in a single pass over entries.
	fillMaxWeights(curWeights, keyToPods[keys[0]], s.MediumWeights)

	// activePods tracks pods still in the consecutive prefix chain.
	activePods := make(map[string]struct{}, len(curWeights))
	for pod, w := range curWeights {
		activePods[pod] = struct{}{}
		podScores[pod] = w
	}

	for i := 1; i < len(keys); i++ {
		if len(activePods) == 0 {
			break
		}

		// Reuse scratch map: clear and refill for current key.
		clear(curWeights)
		fillMaxWeights(curWeights, keyToPods[keys[i]], s.MediumWeights)

		// In-place intersection.
		for pod := range activePods {
			if w, exists := curWeights[pod]; exists {
				podScores[pod] += w
			} else {
				delete(activePods, pod)
			}
		}
	}

	return podScores, nil
}
