/*
 * icount: a QEMU TCG plugin that counts the guest instructions executed, per vCPU, split into
 * user and kernel space, between two markers, with a per-translation-block histogram (an
 * exact, noise-free instruction profile of the rxe guest).
 *
 * A marker is the instruction `xchg %bx,%bx` (66 87 db) executed in user space (`icount-mark`).
 * Each marker appends to the output file the counts since the previous marker and resets them:
 *   mark <n>
 *   vcpu <i> user <insns> kernel <insns>
 *   tb <vcpu> <vaddr hex> <insns> <runs>   (blocks with at least `min` instructions)
 *
 * Usage: qemu ... -plugin /path/libicount.so,out=/path/counts.txt[,min=1000]
 * Built against QEMU's plugin ABI version 1 (QEMU 7.2); only the declarations it uses are
 * written here.
 */
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>

typedef uint64_t qemu_plugin_id_t;
typedef struct qemu_info_t qemu_info_t;
struct qemu_plugin_tb;
struct qemu_plugin_insn;
enum qemu_plugin_cb_flags { QEMU_PLUGIN_CB_NO_REGS, QEMU_PLUGIN_CB_R_REGS, QEMU_PLUGIN_CB_RW_REGS };
typedef void (*tb_trans_cb)(qemu_plugin_id_t id, struct qemu_plugin_tb *tb);
typedef void (*udata_cb)(unsigned int vcpu_index, void *userdata);
void qemu_plugin_register_vcpu_tb_trans_cb(qemu_plugin_id_t id, tb_trans_cb cb);
void qemu_plugin_register_vcpu_tb_exec_cb(struct qemu_plugin_tb *tb, udata_cb cb,
                                          enum qemu_plugin_cb_flags flags, void *userdata);
void qemu_plugin_register_vcpu_insn_exec_cb(struct qemu_plugin_insn *insn, udata_cb cb,
                                            enum qemu_plugin_cb_flags flags, void *userdata);
size_t qemu_plugin_tb_n_insns(const struct qemu_plugin_tb *tb);
uint64_t qemu_plugin_tb_vaddr(const struct qemu_plugin_tb *tb);
struct qemu_plugin_insn *qemu_plugin_tb_get_insn(const struct qemu_plugin_tb *tb, size_t idx);
const void *qemu_plugin_insn_data(const struct qemu_plugin_insn *insn);
size_t qemu_plugin_insn_size(const struct qemu_plugin_insn *insn);

__attribute__((visibility("default"))) int qemu_plugin_version = 1;

#define MAX_VCPUS 8
#define KERNEL_START 0xffff800000000000ull

/* One translated block; retranslations get their own (summed when dumped). */
struct block {
    uint64_t vaddr;
    uint64_t insns;
    uint64_t runs[MAX_VCPUS];
    struct block *next;
};

static uint64_t user[MAX_VCPUS], kernel[MAX_VCPUS];
static struct block *blocks;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static FILE *out;
static uint64_t min_insns = 1000;
static unsigned marks;

static void on_kernel_tb(unsigned int vcpu, void *b)
{
    struct block *blk = b;
    if (vcpu < MAX_VCPUS) {
        kernel[vcpu] += blk->insns;
        blk->runs[vcpu]++;
    }
}

static void on_user_tb(unsigned int vcpu, void *b)
{
    struct block *blk = b;
    if (vcpu < MAX_VCPUS) {
        user[vcpu] += blk->insns;
        blk->runs[vcpu]++;
    }
}

static int by_vaddr(const void *a, const void *b)
{
    const struct block *x = *(struct block *const *)a, *y = *(struct block *const *)b;
    return x->vaddr < y->vaddr ? -1 : x->vaddr > y->vaddr;
}

static void on_mark(unsigned int vcpu, void *unused)
{
    (void)unused;
    pthread_mutex_lock(&lock);
    fprintf(out, "mark %u vcpu %u\n", marks++, vcpu);
    for (int i = 0; i < MAX_VCPUS; i++) {
        if (user[i] || kernel[i]) {
            fprintf(out, "vcpu %d user %" PRIu64 " kernel %" PRIu64 "\n", i, user[i], kernel[i]);
        }
        user[i] = kernel[i] = 0;
    }
    size_t n = 0;
    for (struct block *b = blocks; b; b = b->next) {
        n++;
    }
    struct block **v = calloc(n ? n : 1, sizeof *v);
    n = 0;
    for (struct block *b = blocks; b; b = b->next) {
        v[n++] = b;
    }
    qsort(v, n, sizeof *v, by_vaddr);
    /* Sum retranslations of one address, per vCPU. */
    for (size_t i = 0; i < n;) {
        uint64_t sum[MAX_VCPUS] = {0}, runs[MAX_VCPUS] = {0};
        size_t j = i;
        for (; j < n && v[j]->vaddr == v[i]->vaddr; j++) {
            for (int c = 0; c < MAX_VCPUS; c++) {
                sum[c] += v[j]->runs[c] * v[j]->insns;
                runs[c] += v[j]->runs[c];
                v[j]->runs[c] = 0;
            }
        }
        for (int c = 0; c < MAX_VCPUS; c++) {
            if (sum[c] >= min_insns) {
                fprintf(out, "tb %d %" PRIx64 " %" PRIu64 " %" PRIu64 "\n", c, v[i]->vaddr,
                        sum[c], runs[c]);
            }
        }
        i = j;
    }
    free(v);
    fflush(out);
    pthread_mutex_unlock(&lock);
}

static const unsigned char MARK[] = {0x66, 0x87, 0xdb};

static void on_trans(qemu_plugin_id_t id, struct qemu_plugin_tb *tb)
{
    (void)id;
    uint64_t vaddr = qemu_plugin_tb_vaddr(tb);
    size_t n = qemu_plugin_tb_n_insns(tb);
    struct block *b = calloc(1, sizeof *b);
    b->vaddr = vaddr;
    b->insns = n;
    pthread_mutex_lock(&lock);
    b->next = blocks;
    blocks = b;
    pthread_mutex_unlock(&lock);
    qemu_plugin_register_vcpu_tb_exec_cb(tb, vaddr >= KERNEL_START ? on_kernel_tb : on_user_tb,
                                         QEMU_PLUGIN_CB_NO_REGS, b);
    if (vaddr >= KERNEL_START) {
        return;
    }
    for (size_t i = 0; i < n; i++) {
        struct qemu_plugin_insn *insn = qemu_plugin_tb_get_insn(tb, i);
        if (qemu_plugin_insn_size(insn) == sizeof MARK &&
            memcmp(qemu_plugin_insn_data(insn), MARK, sizeof MARK) == 0) {
            qemu_plugin_register_vcpu_insn_exec_cb(insn, on_mark, QEMU_PLUGIN_CB_NO_REGS, NULL);
        }
    }
}

__attribute__((visibility("default"))) int qemu_plugin_install(qemu_plugin_id_t id,
                                                               const qemu_info_t *info,
                                                               int argc, char **argv)
{
    (void)info;
    const char *path = "icount.txt";
    for (int i = 0; i < argc; i++) {
        if (strncmp(argv[i], "out=", 4) == 0) {
            path = argv[i] + 4;
        } else if (strncmp(argv[i], "min=", 4) == 0) {
            min_insns = strtoull(argv[i] + 4, NULL, 10);
        }
    }
    out = fopen(path, "a");
    if (!out) {
        return -1;
    }
    qemu_plugin_register_vcpu_tb_trans_cb(id, on_trans);
    return 0;
}
