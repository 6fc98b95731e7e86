/* sdharness.h: a tiny service manager for the tests, playing the part systemd plays for kvcd.
 *
 * It owns what systemd owns in production: the listening sockets of kvcd.socket (kvcd.sock,
 * kvcd.fd.sock, kvcd.admin.sock, kvcd.events.sock), handed to every kvcd it starts with
 * LISTEN_FDS/LISTEN_PID/LISTEN_FDNAMES; the notify socket, read by a thread that answers READY=1,
 * FDSTORE=1 and FDSTOREREMOVE=1 as systemd does; and the fd store, whose fds it hands to the next
 * kvcd it starts. Killing kvcd and starting it again is then exactly a systemd restart. */
#pragma once

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <sys/types.h>

#define SDSVC_SOCKETS   4
#define SDSVC_STORE_MAX 4096

struct sdsvc_fd {
        char name[64];
        int fd;
};

struct sdsvc {
        char root[96]; /* temporary directory */
        char dir[128]; /* kvcd's runtime directory, where the sockets are */
        char log[128]; /* every kvcd's stderr, appended */
        char notify[128];
        int listen_fd[SDSVC_SOCKETS];
        int notify_fd;
        int wake[2]; /* stops the notify thread */
        pid_t pid;   /* the running kvcd, 0 when none */
        pthread_t thread;
        bool thread_started;
        pthread_mutex_t mu;
        pthread_cond_t cond;
        unsigned ready; /* READY=1 seen, over every start */
        struct sdsvc_fd store[SDSVC_STORE_MAX];
        size_t n_store;
};

/* The runtime directory with its four listening sockets and the notify socket, and the thread. */
int sdsvc_init(struct sdsvc *s);
/* Starts kvcd (--runtime-dir, --fd-store, --log-level debug, then extra, NULL-terminated) with the
 * sockets and the whole fd store, and waits for its READY=1. -ETIMEDOUT, or -ECHILD when kvcd
 * exited first. */
int sdsvc_start(struct sdsvc *s, const char *const *extra);
/* Sends sig to kvcd and waits for it to exit: its wait status, or -errno. */
int sdsvc_kill(struct sdsvc *s, int sig);
/* How many fds the store holds whose name starts with prefix ("" for all). */
size_t sdsvc_store_count(struct sdsvc *s, const char *prefix);
/* Stops kvcd if it runs, the thread, closes everything and removes the directory. */
void sdsvc_free(struct sdsvc *s);
