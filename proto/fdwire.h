/* fdwire.h: the fd side channel's message format, beside the ZeroMQ channel.
 *
 * ZeroMQ cannot carry file descriptors, so chunk fds travel over a SOCK_SEQPACKET Unix socket
 * (one message per datagram-like record, SCM_RIGHTS for the fd). The same connection gives
 * kvcd the client's kernel-checked credentials (SO_PEERCRED) and an immediate hang-up when the
 * client dies. The records are fixed-size and little-endian (host order: both ends are on one
 * machine).
 *
 *   kvcd -> client  WELCOME   the 16-byte token the client presents in its ZeroMQ Hello; flag
 *                             DEVICE when the pool is GPU memory (a DEVICE record follows)
 *   kvcd -> client  DEVICE    token holds the GPU's 16-byte UUID: the client maps the pool on
 *                             the device with that UUID (its own ordinal for it may differ)
 *   kvcd -> client  CHUNK     one fd: chunk chunk_idx of chunk_bytes, to map at idx * chunk_bytes;
 *                             flag DEVICE: a CUDA VMM POSIX-fd handle (import it, do not mmap it)
 *   kvcd -> client  UNMAP     give chunk chunk_idx back: it holds nothing of the client's any more
 *   client -> kvcd  UNMAPPED  chunk chunk_idx is unmapped here (the answer to UNMAP); kvcd scrubs
 *                             it and may grant it to another client
 *   client -> kvcd  BYE       the last record of a clean disconnect: the client unmapped the whole
 *                             pool. Without it, a hang-up is a death, and kvcd keeps the client's
 *                             chunks until its process has exited (docs/gpu.md, "Client death")
 *
 * UNMAP/UNMAPPED is the cooperative shrink of docs/gpu.md: no CUDA API lets kvcd revoke a
 * client's mapping, so a chunk goes back only when its client says it let go.
 */
#pragma once

#include <stdint.h>

#define FDWIRE_MAGIC   0x4b564346u /* "KVCF" */
#define FDWIRE_VERSION 1u

enum fdwire_kind {
        FDWIRE_WELCOME = 1,
        FDWIRE_CHUNK = 2,
        FDWIRE_DEVICE = 3,
        FDWIRE_UNMAP = 4,
        FDWIRE_UNMAPPED = 5,
        FDWIRE_BYE = 6,
};

enum fdwire_flags {
        FDWIRE_READ_ONLY = 1u << 0,  /* map without write access */
        FDWIRE_DEVICE_MEM = 1u << 1, /* GPU memory (WELCOME, DEVICE and CHUNK records) */
};

struct fdwire_msg {
        uint32_t magic;
        uint16_t version;
        uint16_t kind;
        uint64_t chunk_idx;
        uint64_t chunk_bytes;
        uint32_t flags;
        uint32_t generation; /* CHUNK: which memory the index holds now (kvcd gives a chunk index fresh
                                memory when it changes owner); the same generation is the same memory */
        uint8_t token[16];
};

/* Sends one record, with fd attached unless fd < 0. Never raises SIGPIPE. -errno on failure
 * (-EAGAIN when the socket is non-blocking and full). */
int fdwire_send(int sock, const struct fdwire_msg *m, int fd);

/* Receives one record, waiting at most timeout_ms (-1: forever). *ret_fd is the attached fd or
 * -1; extra fds are closed. -ENOTCONN when the peer hung up, -ETIMEDOUT, -EPROTO for a record of
 * the wrong size, magic or version (any fd it carried is closed). */
int fdwire_recv(int sock, struct fdwire_msg *m, int *ret_fd, int timeout_ms);
