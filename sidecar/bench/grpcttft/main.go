// Command grpcttft times server-streaming gRPC calls from a client that is not Python: the
// sidecar benchmark uses it to tell the gRPC front's own share of a lone request's time to
// first token from what Python's grpc.aio client adds on its side.
//
// It keeps one HTTP/2 connection (grpc-go) and makes one call per line read on stdin, sending
// the request message given as hex (already serialized: no generated code here) and printing
// one line per call: the seconds to the first response message, or "error: ...". It exits at
// the end of stdin.
//
//	grpcttft -addr 127.0.0.1:50051 -method /infermesh.v1.Inference/Generate -request 0a02...
package main

import (
	"bufio"
	"context"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

// rawCodec passes serialized messages through as they are.
type rawCodec struct{}

func (rawCodec) Marshal(v any) ([]byte, error) { return *(v.(*[]byte)), nil }
func (rawCodec) Unmarshal(data []byte, v any) error {
	p := v.(*[]byte)
	*p = append((*p)[:0], data...)
	return nil
}
func (rawCodec) Name() string { return "raw" }

// call makes one server-streaming call, reads it to its end and returns the time to its first message.
func call(conn *grpc.ClientConn, method string, req []byte, timeout time.Duration) (time.Duration, error) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	t0 := time.Now()
	st, err := conn.NewStream(ctx, &grpc.StreamDesc{ServerStreams: true}, method, grpc.ForceCodec(rawCodec{}))
	if err != nil {
		return 0, err
	}
	if err := st.SendMsg(&req); err != nil {
		return 0, err
	}
	if err := st.CloseSend(); err != nil {
		return 0, err
	}
	var first time.Duration
	for n := 0; ; n++ {
		var m []byte
		err := st.RecvMsg(&m)
		if errors.Is(err, io.EOF) {
			if n == 0 {
				return 0, errors.New("the stream ended without a message")
			}
			return first, nil
		}
		if err != nil {
			return 0, err
		}
		if n == 0 {
			first = time.Since(t0)
		}
	}
}

func main() {
	addr := flag.String("addr", "127.0.0.1:50051", "server address")
	method := flag.String("method", "/infermesh.v1.Inference/Generate", "full method name")
	reqHex := flag.String("request", "", "the request message, serialized, in hex")
	timeout := flag.Duration("timeout", 300*time.Second, "deadline of each call")
	flag.Parse()
	req, err := hex.DecodeString(*reqHex)
	if err != nil {
		fmt.Fprintln(os.Stderr, "grpcttft: -request is not hex:", err)
		os.Exit(2)
	}
	conn, err := grpc.NewClient(*addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		fmt.Fprintln(os.Stderr, "grpcttft:", err)
		os.Exit(1)
	}
	defer conn.Close()
	in := bufio.NewScanner(os.Stdin)
	out := bufio.NewWriter(os.Stdout)
	for in.Scan() {
		if d, err := call(conn, *method, req, *timeout); err != nil {
			fmt.Fprintf(out, "error: %v\n", err)
		} else {
			fmt.Fprintf(out, "%.9f\n", d.Seconds())
		}
		out.Flush()
	}
}
