/* The C view of ferrovod, compiled against include/ferrovod.h and run under mpirun by
 * tests/c_api.rs. Each rank checks values it computes itself and prints C-RANK-PASSED. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <stdint.h>

#include "ferrovod.h"

static int failures = 0;

#define CHECK(cond, ...)                                   \
    do {                                                   \
        if (!(cond)) {                                     \
            fprintf(stderr, "CHECK failed at line %d: ", __LINE__); \
            fprintf(stderr, __VA_ARGS__);                  \
            fprintf(stderr, "\n");                         \
            failures++;                                    \
        }                                                  \
    } while (0)

static const char *last_error(void) {
    static char buf[1024];
    fv_last_error(buf, sizeof buf, NULL);
    return buf;
}

struct alloc_ctx {
    void *ptr;
    uint64_t bytes;
    int64_t shape[4];
    int32_t ndim;
};

static void *alloc_output(void *user, int32_t index, int32_t ndim, const int64_t *shape, uint64_t bytes) {
    struct alloc_ctx *ctx = (struct alloc_ctx *)user;
    (void)index;
    ctx->ptr = malloc(bytes ? bytes : 1);
    ctx->bytes = bytes;
    ctx->ndim = ndim;
    for (int i = 0; i < ndim && i < 4; i++) ctx->shape[i] = shape[i];
    return ctx->ptr;
}

struct done_ctx {
    volatile int calls;
    volatile int status;
};

static void on_done(void *user, fv_handle h, int32_t status) {
    struct done_ctx *ctx = (struct done_ctx *)user;
    (void)h;
    ctx->status = status;
    __atomic_store_n(&ctx->calls, ctx->calls + 1, __ATOMIC_SEQ_CST);
}

/* a callback that reads its own handle's error, as a framework's does (also after shutdown) */
struct query_ctx {
    volatile int calls;
    int32_t status;
    int32_t query_status;
    char msg[512];
};

static void on_done_query(void *user, fv_handle h, int32_t status) {
    struct query_ctx *ctx = (struct query_ctx *)user;
    ctx->status = status;
    ctx->query_status = fv_handle_error(h, ctx->msg, sizeof ctx->msg, NULL);
    __atomic_store_n(&ctx->calls, ctx->calls + 1, __ATOMIC_SEQ_CST);
}

static struct fv_op op_of(int32_t kind, const struct fv_tensor *t, int32_t n) {
    struct fv_op op;
    memset(&op, 0, sizeof op);
    op.kind = kind;
    op.reduce_op = FV_REDUCE_OP_SUM;
    op.prescale = 1.0;
    op.postscale = 1.0;
    op.device = FV_CPU_DEVICE;
    op.tensors = t;
    op.num_tensors = n;
    return op;
}

int main(void) {
    int32_t rank = -1, size = -1;
    fv_handle h = 0;

    /* misuse before init */
    struct fv_metrics m0, m1;
    CHECK(fv_read_metrics(&m0) == FV_STATUS_NOT_INITIALIZED, "metrics before init");
    CHECK(fv_rank(&rank) == FV_STATUS_NOT_INITIALIZED, "rank before init");
    CHECK(strcmp(last_error(), "Horovod has not been initialized; use hvd.init().") == 0, "%s", last_error());
    CHECK(fv_is_initialized() == 0, "is_initialized before init");

    CHECK(fv_init(NULL) == FV_STATUS_OK, "init: %s", last_error());
    CHECK(fv_init(NULL) == FV_STATUS_OK, "second init is a no-op");
    CHECK(fv_is_initialized() == 1, "is_initialized");
    CHECK(fv_rank(&rank) == FV_STATUS_OK && fv_size(&size) == FV_STATUS_OK, "rank/size");
    int32_t local = -1, homog = -1;
    CHECK(fv_local_size(&local) == FV_STATUS_OK && local == size, "local size %d", local);
    CHECK(fv_is_homogeneous(&homog) == FV_STATUS_OK && homog == 1, "homogeneous");
    CHECK(strlen(fv_version()) > 0, "version");
    /* canonical codes, as TensorFlow's errors (absl::StatusCode) number them */
    CHECK(fv_status_code(FV_STATUS_OK) == 0, "ok is code 0");
    CHECK(fv_status_code(FV_STATUS_PRECONDITION) == 9, "precondition is FAILED_PRECONDITION");
    CHECK(fv_status_code(FV_STATUS_INVALID_ARGUMENT) == 3, "invalid argument");
    CHECK(fv_status_code(FV_STATUS_SHUT_DOWN) == 2, "shutdown is UNKNOWN, as in Horovod");
    CHECK(fv_status_code(-7) == 2 && fv_status_code(99) == 2, "no fv_status is UNKNOWN");
    CHECK(fv_built_with("mpi") == 1 && fv_built_with("nccl") == 0, "built with");

    /* misuse after init */
    CHECK(fv_rank(NULL) == FV_STATUS_INVALID_ARGUMENT, "null out");
    CHECK(fv_enqueue(NULL, &h) == FV_STATUS_INVALID_ARGUMENT, "null op");
    CHECK(fv_wait(987654321, 0.0) == FV_STATUS_INVALID_ARGUMENT, "unknown handle");
    CHECK(strstr(last_error(), "unknown handle") != NULL, "%s", last_error());
    CHECK(fv_release(987654321) == FV_STATUS_INVALID_ARGUMENT, "release unknown");
    {
        struct fv_tensor t;
        memset(&t, 0, sizeof t);
        t.name = "nullinput";
        t.dtype = FV_DTYPE_F32;
        int64_t shape[1] = {4};
        t.ndim = 1;
        t.shape = shape;
        struct fv_op op = op_of(FV_OP_KIND_ALLREDUCE, &t, 1);
        CHECK(fv_enqueue(&op, &h) == FV_STATUS_INVALID_ARGUMENT, "null input");
        t.dtype = 77;
        CHECK(fv_enqueue(&op, &h) == FV_STATUS_INVALID_ARGUMENT, "bad dtype");
        op.kind = 99;
        CHECK(fv_enqueue(&op, &h) == FV_STATUS_INVALID_ARGUMENT, "bad kind");
        float buf[5] = {0};
        t.dtype = FV_DTYPE_F32;
        t.input = buf;
        t.output = buf + 1; /* overlaps the input without being it */
        op.kind = FV_OP_KIND_ALLREDUCE;
        CHECK(fv_enqueue(&op, &h) == FV_STATUS_INVALID_ARGUMENT, "overlapping output");
        CHECK(strstr(last_error(), "overlaps") != NULL, "%s", last_error());
        t.output = NULL;
        op.timeout = -1.0; /* an operation's own timeout must be a length of time */
        CHECK(fv_enqueue(&op, &h) == FV_STATUS_INVALID_ARGUMENT, "negative timeout");
        CHECK(strstr(last_error(), "timeout") != NULL, "%s", last_error());
        op.timeout = INFINITY;
        CHECK(fv_enqueue(&op, &h) == FV_STATUS_INVALID_ARGUMENT, "infinite timeout");
    }
    {
        /* two tensors of one grouped allreduce sharing memory that it writes */
        float buf[8] = {0};
        int64_t shape[1] = {4};
        struct fv_tensor ts[2] = {
            {"alias.a", FV_DTYPE_F32, 1, shape, buf, buf, NULL, 0},
            {"alias.b", FV_DTYPE_F32, 1, shape, buf + 2, buf + 2, NULL, 0},
        };
        struct fv_op op = op_of(FV_OP_KIND_ALLREDUCE, ts, 2);
        CHECK(fv_enqueue(&op, &h) == FV_STATUS_INVALID_ARGUMENT, "aliased group");
        CHECK(strstr(last_error(), "share memory") != NULL, "%s", last_error());
        /* one tensor's output on another's input */
        float other[4] = {0};
        ts[1].input = other;
        ts[1].output = buf + 1;
        CHECK(fv_enqueue(&op, &h) == FV_STATUS_INVALID_ARGUMENT, "output on another input");
    }

    /* send and receive around the ring, the tag in the op */
    {
        int32_t max_tag = -1;
        CHECK(fv_p2p_max_tag(&max_tag) == FV_STATUS_OK && max_tag >= 16383, "max tag %d", max_tag);
        double out[6], in[6];
        for (int i = 0; i < 6; i++) out[i] = 100.0 * rank + i;
        int64_t shape[1] = {6};
        struct fv_tensor ts = {"c.send", FV_DTYPE_F64, 1, shape, out, NULL, NULL, 0};
        struct fv_tensor tr = {"c.recv", FV_DTYPE_F64, 1, shape, in, in, NULL, 0};
        struct fv_op send = op_of(FV_OP_KIND_SEND, &ts, 1);
        struct fv_op recv = op_of(FV_OP_KIND_RECV, &tr, 1);
        send.root_rank = (rank + 1) % size;
        recv.root_rank = (rank + size - 1) % size;
        send.tag = recv.tag = 7;
        fv_handle hs = 0, hr = 0;
        CHECK(fv_enqueue(&recv, &hr) == FV_STATUS_OK, "recv enqueue: %s", last_error());
        CHECK(fv_enqueue(&send, &hs) == FV_STATUS_OK, "send enqueue: %s", last_error());
        CHECK(fv_wait(hr, 60.0) == FV_STATUS_OK && fv_wait(hs, 60.0) == FV_STATUS_OK, "p2p wait");
        int prev = (rank + size - 1) % size;
        for (int i = 0; i < 6; i++) CHECK(in[i] == 100.0 * prev + i, "received %g", in[i]);
        fv_release(hs);
        fv_release(hr);
        send.tag = -2;
        CHECK(fv_enqueue(&send, &hs) == FV_STATUS_INVALID_ARGUMENT, "negative tag");
        CHECK(strstr(last_error(), "tag -2") != NULL, "%s", last_error());
    }

    /* allreduce, in place, waited on by handle */
    {
        float data[1000];
        for (int i = 0; i < 1000; i++) data[i] = (float)(i % 17 + rank);
        int64_t shape[1] = {1000};
        struct fv_tensor t = {"c.allreduce", FV_DTYPE_F32, 1, shape, data, data, NULL, 0};
        struct fv_op op = op_of(FV_OP_KIND_ALLREDUCE, &t, 1);
        CHECK(fv_enqueue(&op, &h) == FV_STATUS_OK, "allreduce enqueue: %s", last_error());
        CHECK(fv_wait(h, 60.0) == FV_STATUS_OK, "allreduce wait: %s", last_error());
        CHECK(fv_wait(h, 0.0 / 0.0) == FV_STATUS_INVALID_ARGUMENT, "wait NaN");
        CHECK(fv_wait(h, 1.0 / 0.0) == FV_STATUS_OK, "wait +inf: %s", last_error());
        CHECK(fv_wait(h, 1e20) == FV_STATUS_OK, "wait 1e20: %s", last_error());
        int64_t dims[2];
        int32_t nd = 0;
        CHECK(fv_handle_shape(h, -1, dims, 2, &nd) == FV_STATUS_INVALID_ARGUMENT, "negative index");
        int32_t done = 0;
        CHECK(fv_poll(h, &done) == FV_STATUS_OK && done == 1, "poll");
        CHECK(fv_release(h) == FV_STATUS_OK, "release");
        for (int i = 0; i < 1000; i++) {
            float want = (float)(size * (i % 17) + size * (size - 1) / 2);
            if (data[i] != want) {
                CHECK(0, "allreduce[%d] = %f, want %f", i, data[i], want);
                break;
            }
        }
    }

    /* multistep: every 2nd call communicates the sum of two calls; fv_handle_value says which */
    {
        float data[4];
        int64_t shape[1] = {4};
        struct fv_tensor t = {"c.multistep", FV_DTYPE_F32, 1, shape, data, data, NULL, 0};
        struct fv_op op = op_of(FV_OP_KIND_ALLREDUCE, &t, 1);
        op.multistep = 2;
        op.multistep_mode = FV_MULTISTEP_MODE_ACCUMULATE;
        for (int call = 0; call < 4; call++) {
            for (int i = 0; i < 4; i++) data[i] = (float)(i + call + rank);
            CHECK(fv_enqueue(&op, &h) == FV_STATUS_OK, "multistep enqueue: %s", last_error());
            CHECK(fv_wait(h, 60.0) == FV_STATUS_OK, "multistep wait: %s", last_error());
            int32_t sent = -1;
            CHECK(fv_handle_value(h, &sent) == FV_STATUS_OK && sent == call % 2, "multistep call %d sent %d", call, sent);
            CHECK(fv_release(h) == FV_STATUS_OK, "release");
            for (int i = 0; i < 4; i++) {
                /* the two calls' inputs summed over the ranks, or this call's input untouched */
                float want = call % 2 == 0 ? (float)(i + call + rank)
                                           : (float)(size * (2 * i + 2 * call - 1) + size * (size - 1));
                CHECK(data[i] == want, "multistep call %d [%d] = %f, want %f", call, i, data[i], want);
            }
        }
        op.multistep_mode = 7;
        CHECK(fv_enqueue(&op, &h) == FV_STATUS_INVALID_ARGUMENT, "unknown multistep mode");
        op.multistep_mode = 0;
        op.multistep = -1;
        CHECK(fv_enqueue(&op, &h) == FV_STATUS_INVALID_ARGUMENT, "negative multistep");
    }

    /* gossip: the neighbour average; the sum over the ranks is kept */
    {
        double data[3];
        for (int i = 0; i < 3; i++) data[i] = (double)(10 * rank + i);
        int64_t shape[1] = {3};
        struct fv_tensor t = {"c.gossip", FV_DTYPE_F64, 1, shape, data, data, NULL, 0};
        struct fv_op op = op_of(FV_OP_KIND_GOSSIP, &t, 1);
        CHECK(fv_enqueue(&op, &h) == FV_STATUS_OK, "gossip enqueue: %s", last_error());
        CHECK(fv_wait(h, 60.0) == FV_STATUS_OK && fv_release(h) == FV_STATUS_OK, "gossip: %s", last_error());
        /* on a power of two, round 0 pairs rank 2k with 2k + 1 (the hypercube) */
        int peer = (size & (size - 1)) == 0 && size > 1 ? (rank ^ 1) : -1;
        if (peer >= 0) {
            for (int i = 0; i < 3; i++) {
                double want = (double)(5 * (rank + peer) + i);
                CHECK(data[i] == want, "gossip[%d] = %f, want %f", i, data[i], want);
            }
        }
    }

    /* average of doubles, out of place, completed by callback, handle auto-released */
    {
        double in[8], out[8];
        for (int i = 0; i < 8; i++) in[i] = (double)(rank + i);
        int64_t shape[2] = {2, 4};
        struct fv_tensor t = {"c.average", FV_DTYPE_F64, 2, shape, in, out, NULL, 0};
        struct fv_op op = op_of(FV_OP_KIND_ALLREDUCE, &t, 1);
        op.reduce_op = FV_REDUCE_OP_AVERAGE;
        struct done_ctx dc = {0, -1};
        op.done = on_done;
        op.done_user_data = &dc;
        CHECK(fv_enqueue(&op, NULL) == FV_STATUS_OK, "average enqueue: %s", last_error());
        while (__atomic_load_n(&dc.calls, __ATOMIC_SEQ_CST) == 0) {
        }
        CHECK(dc.status == FV_STATUS_OK, "average status %d", dc.status);
        for (int i = 0; i < 8; i++) {
            double want = (double)(size - 1) / 2.0 + i;
            CHECK(out[i] == want, "average[%d] = %f, want %f", i, out[i], want);
            CHECK(in[i] == (double)(rank + i), "input untouched");
        }
    }

    /* allgather with uneven first dimension: rank r sends r + 1 rows of 3 int32 */
    {
        int32_t rows = rank + 1;
        int32_t *in = malloc(sizeof(int32_t) * rows * 3);
        for (int i = 0; i < rows * 3; i++) in[i] = rank * 100 + i;
        int64_t shape[2] = {rows, 3};
        struct fv_tensor t = {"c.allgather", FV_DTYPE_I32, 2, shape, in, NULL, NULL, 0};
        struct fv_op op = op_of(FV_OP_KIND_ALLGATHER, &t, 1);
        struct alloc_ctx ac;
        memset(&ac, 0, sizeof ac);
        op.alloc = alloc_output;
        op.alloc_user_data = &ac;
        CHECK(fv_enqueue(&op, &h) == FV_STATUS_OK, "allgather enqueue: %s", last_error());
        CHECK(fv_wait(h, 60.0) == FV_STATUS_OK, "allgather wait: %s", last_error());
        int64_t total_rows = (int64_t)size * (size + 1) / 2;
        CHECK(ac.ndim == 2 && ac.shape[0] == total_rows && ac.shape[1] == 3, "allgather shape");
        CHECK(ac.bytes == (uint64_t)(total_rows * 3 * 4), "allgather bytes");
        int64_t got_shape[4];
        int32_t ndim = 0;
        CHECK(fv_handle_shape(h, 0, got_shape, 4, &ndim) == FV_STATUS_OK && ndim == 2 && got_shape[0] == total_rows,
              "handle shape");
        const int32_t *out = (const int32_t *)ac.ptr;
        int64_t k = 0;
        for (int r = 0; r < size; r++)
            for (int i = 0; i < (r + 1) * 3; i++, k++)
                CHECK(out[k] == r * 100 + i, "allgather[%ld] = %d", (long)k, out[k]);
        fv_release(h);
        free(ac.ptr);
        free(in);
    }

    /* allgather without an allocator: ferrovod owns the output until release */
    {
        uint8_t in[2] = {(uint8_t)rank, (uint8_t)(rank + 10)};
        int64_t shape[1] = {2};
        struct fv_tensor t = {"c.allgather.owned", FV_DTYPE_U8, 1, shape, in, NULL, NULL, 0};
        struct fv_op op = op_of(FV_OP_KIND_ALLGATHER, &t, 1);
        CHECK(fv_enqueue(&op, &h) == FV_STATUS_OK, "owned allgather: %s", last_error());
        CHECK(fv_wait(h, 60.0) == FV_STATUS_OK, "owned allgather wait");
        const void *p = NULL;
        uint64_t bytes = 0;
        CHECK(fv_handle_output(h, 0, &p, &bytes) == FV_STATUS_OK && bytes == (uint64_t)(2 * size), "owned output");
        for (int r = 0; r < size && p; r++)
            CHECK(((const uint8_t *)p)[2 * r] == r && ((const uint8_t *)p)[2 * r + 1] == r + 10, "owned allgather values");
        fv_release(h);
    }

    /* allgather and reducescatter into outputs given up front (every rank one shape) */
    {
        int32_t in[6];
        for (int i = 0; i < 6; i++) in[i] = rank * 100 + i;
        int32_t *out = malloc(sizeof(int32_t) * 6 * size);
        int64_t shape[2] = {2, 3};
        struct fv_tensor t = {"c.allgather.given", FV_DTYPE_I32, 2, shape, in, out, NULL, 0};
        struct fv_op op = op_of(FV_OP_KIND_ALLGATHER, &t, 1);
        CHECK(fv_enqueue(&op, &h) == FV_STATUS_OK, "given allgather: %s", last_error());
        CHECK(fv_wait(h, 60.0) == FV_STATUS_OK, "given allgather wait: %s", last_error());
        fv_release(h);
        for (int r = 0; r < size; r++)
            for (int i = 0; i < 6; i++)
                CHECK(out[r * 6 + i] == r * 100 + i, "given allgather[%d] = %d", r * 6 + i, out[r * 6 + i]);
        free(out);

        float *rin = malloc(sizeof(float) * 4 * size);
        for (int i = 0; i < 4 * size; i++) rin[i] = (float)(rank + i);
        float rout[4] = {-1, -1, -1, -1};
        int64_t rshape[2] = {2 * size, 2};
        struct fv_tensor rt = {"c.reducescatter.given", FV_DTYPE_F32, 2, rshape, rin, rout, NULL, 0};
        op = op_of(FV_OP_KIND_REDUCESCATTER, &rt, 1);
        CHECK(fv_enqueue(&op, &h) == FV_STATUS_OK, "given reducescatter: %s", last_error());
        CHECK(fv_wait(h, 60.0) == FV_STATUS_OK, "given reducescatter wait: %s", last_error());
        fv_release(h);
        /* rank r keeps rows 2r and 2r + 1: element i of them sums rank + 4r + i over ranks */
        for (int i = 0; i < 4; i++) {
            float want = (float)(size * (4 * rank + i) + size * (size - 1) / 2);
            CHECK(rout[i] == want, "given reducescatter[%d] = %g, want %g", i, rout[i], want);
        }

        /* refused at the call: a first dimension the ranks do not divide, an overlap on the
         * host, outputs for some tensors only */
        int64_t odd[1] = {2 * size + 1};
        struct fv_tensor bad = {"c.rs.odd", FV_DTYPE_F32, 1, odd, rin, rout, NULL, 0};
        op = op_of(FV_OP_KIND_REDUCESCATTER, &bad, 1);
        CHECK(fv_enqueue(&op, &h) == FV_STATUS_INVALID_ARGUMENT &&
                  strstr(last_error(), "a given output needs a first dimension the set's"),
              "odd reducescatter: %s", last_error());
        int64_t two[1] = {2};
        struct fv_tensor over = {"c.ag.over", FV_DTYPE_F32, 1, two, rin, rin, NULL, 0};
        op = op_of(FV_OP_KIND_ALLGATHER, &over, 1);
        CHECK(fv_enqueue(&op, &h) == FV_STATUS_INVALID_ARGUMENT &&
                  strstr(last_error(), "the given output overlaps the input"),
              "overlapping allgather: %s", last_error());
        float o2[2 * 64];
        struct fv_tensor some[2] = {{"c.ag.some0", FV_DTYPE_F32, 1, two, rin, o2, NULL, 0},
                                    {"c.ag.some1", FV_DTYPE_F32, 1, two, rin + 2, NULL, NULL, 0}};
        op = op_of(FV_OP_KIND_ALLGATHER, some, 2);
        CHECK(fv_enqueue(&op, &h) == FV_STATUS_INVALID_ARGUMENT &&
                  strstr(last_error(), "give the output of every tensor of the operation, or of none"),
              "some outputs: %s", last_error());
        /* one tensor's output over the other's */
        some[1].output = o2 + 1;
        CHECK(fv_enqueue(&op, &h) == FV_STATUS_INVALID_ARGUMENT &&
                  strstr(last_error(), "share memory that the operation writes"),
              "crossed outputs: %s", last_error());
        /* one tensor's output over the other's input */
        some[1].output = o2 + 2 * size;
        some[1].input = o2 + 1;
        CHECK(fv_enqueue(&op, &h) == FV_STATUS_INVALID_ARGUMENT &&
                  strstr(last_error(), "share memory that the operation writes"),
              "output over another input: %s", last_error());
        /* two tensors reading one input, each into its own output: allowed */
        some[1].input = rin;
        CHECK(fv_enqueue(&op, &h) == FV_STATUS_OK, "shared input: %s", last_error());
        CHECK(fv_wait(h, 60.0) == FV_STATUS_OK, "shared input wait: %s", last_error());
        fv_release(h);
        for (int r = 0; r < size; r++)
            for (int i = 0; i < 2; i++)
                CHECK(o2[2 * r + i] == (float)(r + i) && o2[2 * size + 2 * r + i] == (float)(r + i),
                      "shared input allgather[%d]: %g and %g", 2 * r + i, o2[2 * r + i],
                      o2[2 * size + 2 * r + i]);
        /* outputs and an allocator */
        struct alloc_ctx unused;
        op = op_of(FV_OP_KIND_ALLGATHER, &t, 1);
        op.alloc = alloc_output;
        op.alloc_user_data = &unused;
        t.output = o2;
        CHECK(fv_enqueue(&op, &h) == FV_STATUS_INVALID_ARGUMENT &&
                  strstr(last_error(), "pass the outputs or an allocator, not both"),
              "outputs and allocator: %s", last_error());
        free(rin);

        /* ranks that give different shapes: rank r gathers r + 1 rows into an output of
         * size * (r + 1) rows; the agreed total is size * (size + 1) / 2 rows, so the tensor
         * fails on every rank whose output does not hold that (all of them at an even size),
         * and nobody waits */
        int32_t rows = rank + 1;
        int32_t *uin = malloc(sizeof(int32_t) * rows);
        int32_t *uout = malloc(sizeof(int32_t) * rows * size);
        for (int i = 0; i < rows; i++) uin[i] = rank;
        int64_t ushape[1] = {rows};
        struct fv_tensor ut = {"c.allgather.given.uneven", FV_DTYPE_I32, 1, ushape, uin, uout, NULL, 0};
        op = op_of(FV_OP_KIND_ALLGATHER, &ut, 1);
        CHECK(fv_enqueue(&op, &h) == FV_STATUS_OK, "uneven given allgather: %s", last_error());
        int32_t st = fv_wait(h, 60.0);
        char msg[512] = {0};
        fv_handle_error(h, msg, sizeof msg, NULL);
        if (2 * (rank + 1) != size + 1)
            CHECK(st != FV_STATUS_OK && strstr(msg, "ranks gave different shapes"),
                  "uneven given allgather: status %d, '%s'", st, msg);
        else
            CHECK(st == FV_STATUS_OK, "uneven given allgather that fits: status %d, '%s'", st, msg);
        fv_release(h);
        free(uin);
        free(uout);
    }

    /* the completion queue: a done callback that queues, taken by this thread */
    {
        int32_t v = 1;
        int64_t shape[1] = {1};
        struct fv_tensor t = {"c.queued", FV_DTYPE_I32, 1, shape, &v, NULL, NULL, 0};
        struct fv_op op = op_of(FV_OP_KIND_ALLREDUCE, &t, 1);
        op.done = fv_queue_completion;
        op.done_user_data = (void *)(uintptr_t)42;
        CHECK(fv_enqueue(&op, &h) == FV_STATUS_OK, "queued enqueue: %s", last_error());
        void *ud = NULL;
        fv_handle got = 0;
        int32_t st = -1;
        CHECK(fv_next_completion(60.0, &ud, &got, &st) == FV_STATUS_OK, "next completion: %s", last_error());
        CHECK((uintptr_t)ud == 42 && got == h && st == FV_STATUS_OK, "queued completion %lu %lu %d",
              (unsigned long)(uintptr_t)ud, (unsigned long)got, st);
        CHECK(v == size, "queued allreduce = %d", v);
        fv_release(h);
        /* a waiter that completes the operation itself forgets it: never delivered */
        v = 1;
        t.name = "c.queued.forgotten";
        CHECK(fv_enqueue(&op, &h) == FV_STATUS_OK, "forgotten enqueue: %s", last_error());
        int32_t dropped = -1;
        CHECK(fv_forget_completion(h, &dropped) == FV_STATUS_OK && (dropped == 0 || dropped == 1),
              "forget: %d", dropped);
        CHECK(fv_wait(h, 60.0) == FV_STATUS_OK && v == size, "forgotten op completes");
        if (dropped == 0) {
            /* it had just finished, its completion on the way: it comes out */
            CHECK(fv_next_completion(60.0, &ud, &got, &st) == FV_STATUS_OK && got == h, "on its way");
        }
        fv_release(h);
        CHECK(fv_next_completion(0.05, &ud, &got, &st) == FV_STATUS_TIMEOUT, "nothing left: %s", last_error());
        CHECK(fv_next_completion(0.0, NULL, &got, &st) == FV_STATUS_INVALID_ARGUMENT, "null output");
        CHECK(fv_forget_completion(h, NULL) == FV_STATUS_INVALID_ARGUMENT, "null dropped");
    }

    /* broadcast from the last rank, in place */
    {
        int64_t data[5];
        for (int i = 0; i < 5; i++) data[i] = (int64_t)rank * 1000 + i;
        int64_t shape[1] = {5};
        struct fv_tensor t = {"c.broadcast", FV_DTYPE_I64, 1, shape, data, NULL, NULL, 0};
        struct fv_op op = op_of(FV_OP_KIND_BROADCAST, &t, 1);
        op.root_rank = size - 1;
        CHECK(fv_enqueue(&op, &h) == FV_STATUS_OK, "broadcast enqueue: %s", last_error());
        CHECK(fv_wait(h, 60.0) == FV_STATUS_OK, "broadcast wait: %s", last_error());
        fv_release(h);
        for (int i = 0; i < 5; i++) CHECK(data[i] == (int64_t)(size - 1) * 1000 + i, "broadcast[%d]", i);
    }

    /* a cross-rank mismatch reaches every rank with a message */
    {
        float data[3] = {1, 2, 3};
        int64_t shape[1] = {rank == 0 ? 2 : 3};
        struct fv_tensor t = {"c.mismatch", FV_DTYPE_F32, 1, shape, data, NULL, NULL, 0};
        struct fv_op op = op_of(FV_OP_KIND_ALLREDUCE, &t, 1);
        CHECK(fv_enqueue(&op, &h) == FV_STATUS_OK, "mismatch enqueue");
        CHECK(fv_wait(h, 60.0) == FV_STATUS_PRECONDITION, "mismatch status");
        char msg[512];
        size_t needed = 0;
        CHECK(fv_handle_error(h, msg, sizeof msg, &needed) == FV_STATUS_OK, "handle error");
        CHECK(strstr(msg, "Mismatched ALLREDUCE tensor shapes") != NULL, "mismatch text: %s", msg);
        fv_release(h);
    }

    /* process sets through the C API */
    {
        int32_t ranks[1] = {0};
        int32_t id = -1, n = 0, ids[8];
        CHECK(fv_add_process_set(ranks, 1, &id) == FV_STATUS_OK && id == 1, "add set: %s", last_error());
        CHECK(fv_process_set_ids(ids, 8, &n) == FV_STATUS_OK && n == 2 && ids[1] == 1, "list sets");
        int32_t in_set = -2;
        CHECK(fv_process_set_rank(1, &in_set) == FV_STATUS_OK && in_set == (rank == 0 ? 0 : -1), "rank in set");
        CHECK(fv_remove_process_set(0) == FV_STATUS_INVALID_ARGUMENT, "remove global set");
        CHECK(fv_remove_process_set(1) == FV_STATUS_OK, "remove set: %s", last_error());
    }

    /* metrics: a barrier adds no data bytes and at least one negotiation cycle */
    CHECK(fv_read_metrics(NULL) == FV_STATUS_INVALID_ARGUMENT, "metrics null");
    CHECK(fv_read_metrics(&m0) == FV_STATUS_OK, "metrics: %s", last_error());
    {
        struct fv_op op = op_of(FV_OP_KIND_BARRIER, NULL, 0);
        CHECK(fv_enqueue(&op, &h) == FV_STATUS_OK && fv_wait(h, 60.0) == FV_STATUS_OK, "barrier");
        fv_release(h);
    }
    CHECK(fv_read_metrics(&m1) == FV_STATUS_OK, "metrics");
    CHECK(m1.cycles > m0.cycles && m1.control_collectives > m0.control_collectives, "cycles counted");
    CHECK(m1.data_bytes == m0.data_bytes && m1.tensors >= m0.tensors && m0.tensors > 0, "data counters");

    /* barrier, then shut down */
    {
        struct fv_op op = op_of(FV_OP_KIND_BARRIER, NULL, 0);
        CHECK(fv_enqueue(&op, &h) == FV_STATUS_OK && fv_wait(h, 60.0) == FV_STATUS_OK, "barrier");
        fv_release(h);
    }
    /* an operation no other rank submits, failed by the shutdown: its callback still reads
       its handle */
    struct query_ctx q;
    memset(&q, 0, sizeof q);
    {
        static float lone[2] = {1, 2};
        static char name[64];
        static int64_t shape[1] = {2};
        snprintf(name, sizeof name, "only.on.rank%d", rank);
        static struct fv_tensor t;
        t = (struct fv_tensor){name, FV_DTYPE_F32, 1, shape, lone, lone, NULL, 0};
        struct fv_op op = op_of(FV_OP_KIND_ALLREDUCE, &t, 1);
        op.done = on_done_query;
        op.done_user_data = &q;
        CHECK(fv_enqueue(&op, NULL) == FV_STATUS_OK, "lone enqueue: %s", last_error());
    }
    CHECK(fv_shutdown() == FV_STATUS_OK, "shutdown");
    CHECK(__atomic_load_n(&q.calls, __ATOMIC_SEQ_CST) == 1, "callback of a failed op ran once");
    CHECK(q.status == FV_STATUS_SHUT_DOWN, "failed op status %d", q.status);
    CHECK(q.query_status == FV_STATUS_OK, "handle query in the callback: %d", q.query_status);
    CHECK(strstr(q.msg, "shut down") != NULL, "callback read: %s", q.msg);
    CHECK(fv_is_initialized() == 0, "is_initialized after shutdown");
    CHECK(fv_rank(&rank) == FV_STATUS_NOT_INITIALIZED, "rank after shutdown");

    if (failures == 0) printf("C-RANK-PASSED\n");
    return failures == 0 ? 0 : 1;
}
